"""benchmarks/bench_llama_bench.py reads llama.cpp's tools' own output (samples below are from
the llama.cpp vendored in llama-cpp-python 0.3.36: llama-bench -o json, llama-batched-bench
--output-format jsonl -lv 4, llama-perplexity) and measures a process's peak memory; no llama.cpp
binary is needed here."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_llama_bench import (  # noqa: E402
    parse_batched_bench,
    parse_llama_bench,
    parse_load_ms,
    parse_perplexity,
    run_measured,
)

LLAMA_BENCH = """0.00.100.000 W some warning [with brackets]
[
  {
    "build_commit": "0c1e570",
    "cpu_info": "AMD EPYC",
    "n_prompt": 128,
    "n_gen": 0,
    "avg_ts": 1067.5,
    "samples_ts": [ 1067.5 ]
  },
  {
    "build_commit": "0c1e570",
    "cpu_info": "AMD EPYC",
    "n_prompt": 0,
    "n_gen": 128,
    "avg_ts": 202.25,
    "samples_ts": [ 202.25 ]
  }
]
"""

BATCHED_BENCH = """0.00.523.844 W llama_context: n_ctx is not divisible by n_seq_max - \
rounding down to 512
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 1, "n_threads_batch": 1, "pp": 128, "tg": 128, "pl": 1, \
"n_kv": 256, "t_pp": 0.12, "speed_pp": 1066.666, "t_tg": 0.64, "speed_tg": 200.0, "t": 0.76, \
"speed": 336.8}
{"n_kv_max": 4096, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, \
"n_gpu_layers": -1, "n_threads": 1, "n_threads_batch": 1, "pp": 128, "tg": 128, "pl": 16, \
"n_kv": 4096, "t_pp": 2.048, "speed_pp": 1000.0, "t_tg": 4.096, "speed_tg": 500.0, "t": 6.144, \
"speed": 666.7}
0.01.200.805 I llama_perf_context_print:        load time =     766.53 ms
"""

PERPLEXITY = """0.01.620.712 I system_info: n_threads = 1 (n_threads_batch = 1) / 2 | \
CPU : AVX2 = 1 | AVX512 = 1 | OPENMP = 1 | REPACK = 1 | \n[1]29.1133,[2]43.2687,
0.26.486.182 I Final estimate: PPL = 43.2687 +/- 2.93717
"""


def test_llama_bench_rows_despite_log_lines_and_nested_brackets():
    pp, tg, system = parse_llama_bench(LLAMA_BENCH)
    assert (pp, tg) == (1067.5, 202.25) and system["cpu_info"] == "AMD EPYC"


def test_batched_bench_speeds_by_sequences_and_load_time():
    assert parse_batched_bench(BATCHED_BENCH) == {1: (1066.666, 200.0), 16: (1000.0, 500.0)}
    assert parse_load_ms(BATCHED_BENCH) == 766.53


def test_perplexity_estimate_and_system_info():
    ppl, info = parse_perplexity(PERPLEXITY)
    assert ppl == 43.2687 and info.startswith("n_threads = 1") and info.endswith("REPACK = 1")
    with pytest.raises(SystemExit, match="no estimate"):
        parse_perplexity("failed to load model\n")


def test_peak_rss_seen_and_failure_named():
    code = "b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); print('ok')"
    text, peak = run_measured([sys.executable, "-c", code])
    assert text.strip() == "ok" and peak >= 300 * 2**20
    with pytest.raises(SystemExit, match=r"^python\S* failed \(3\)"):
        run_measured([sys.executable, "-c", "raise SystemExit(3)"])
