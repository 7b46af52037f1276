"""benchmarks/bench_before_after.py reads each benchmark's figures from the lines the scripts
print (copied here from real runs), and finds nothing in output that lacks them."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_before_after import BENCHES  # noqa: E402

OUTPUTS = {
    "generate": (
        "batch 1      B=1   prompt=64    new=32   transformers     50.3 tok/s | lmforge    251.8 "
        "tok/s | ratio  5.00x (target >= 2.5x: ok) | tokens agree 97% (first divergence at "
        "step 30)\n"
        "batch 16     B=16  prompt=64    new=32   transformers    212.1 tok/s | lmforge    879.8 "
        "tok/s | ratio  4.15x (target >= 2.0x: ok) | tokens agree 78% (first divergence at "
        "step 0)\n",
        {"lmforge batch 1 tok/s": 251.8, "transformers batch 16 tok/s (control)": 212.1},
    ),
    "generate-fp32": (  # today's lines, with the ratio in CPU time
        "batch 16     B=16  prompt=64    new=256  transformers    273.5 tok/s | lmforge    637.2 "
        "tok/s | ratio  2.33x (target >= 3.0x: MISSED) | in CPU time  2.27x | tokens identical\n",
        {"lmforge batch 16 tok/s": 637.2, "lmforge / transformers, batch 16": 2.33},
    ),
    "dpo": (
        "repeat 1: ours 3.10 steps/s\n\nmedian steps/s  lmforge 3.21  TRL 1.50  (lmforge with "
        "precompute_ref 4.00)\nspeed-up vs TRL (same per-step reference forward): 2.14x\n",
        {"lmforge DPO steps/s": 3.21, "TRL DPO steps/s (control)": 1.5},
    ),
    "llamacpp": (
        "rep 1 1 thr batch 1 transformers fp32  prefill     812 tok/s  decode   38.5 tok/s\n"
        "rep 1 1 thr batch 1 lmforge int8       prefill    1204 tok/s  decode  140.2 tok/s\n",
        {"lmforge int8 decode tok/s": 140.2, "transformers fp32 prefill tok/s (control)": 812.0},
    ),
    "pretrain": (
        "final: step 300  val loss 2.4000  val perplexity 11.02  val bits/byte 3.5000  "
        "7,680 tokens/s  (after the first 10 steps: 7,837 tokens/s)  30.0 s training\n",
        {"pretrain tokens/s": 7680.0, "pretrain iterations/s": 10.0},
    ),
}


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_figures_parsed_from_the_printed_lines(bench):
    text, expected = OUTPUTS[bench]
    _, parse = BENCHES[bench]
    figures = parse(text)
    for name, value in expected.items():
        assert figures[name] == pytest.approx(value)
    assert parse("Traceback (most recent call last):\n  ...\nRuntimeError: boom\n") == {}
