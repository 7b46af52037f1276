"""GRPO's sampling phase at the speedrun's setting: the old generation loop vs the engine.

Setting (lmforge/speedrun/presets.yaml, cpu-tiny): the pretrain model (4 layers, d_model 128, 4
heads, learned positions, LayerNorm, GELU, no biases; byte-level BPE of 2048 tokens with split
digits), GRPO with 64 prompts of the 2-digit addition task per step, a group of 8 completions
each, up to 6 new tokens at temperature 1.0: 512 sequences per step. The model is randomly
initialised (sampling cost does not depend on what the weights say; a random model rarely
stops early, so every row decodes all 6 tokens).

- old: the plain generation loop rollouts used before the engine, kept as the engine's test
  reference (tests/infer/reference_generate.py) and imported from there: the 512 rows (each
  prompt repeated 8 times) prefilled together, then 5 decode steps over all rows.
- new: `RolloutEngine.generate` (lmforge/align/rollout.py): the engine prefills the 64 distinct
  prompts once, copies each prompt's keys to its group's 8 rows, and decodes the 512 rows.

Both run in one process, alternating, after a warm-up; the median of --repeats is reported as
generated tokens per second (the machine is shared, so only the ratio means much).

    python benchmarks/bench_rollout.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import torch

from lmforge.align.data import prompt_ids
from lmforge.align.rollout import RolloutEngine, default_stop_ids
from lmforge.infer.params import GenerationParams
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tasks.synthetic import problems
from lmforge.tokenizer import Tokenizer

PROMPTS, GROUP, NEW_TOKENS, TEMPERATURE = 64, 8, 6, 1.0
REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "infer" / "reference_generate.py"


def reference_module():
    spec = importlib.util.spec_from_file_location("reference_generate", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup():
    records = problems("add", 2000, seed=1337, digits=2)
    texts = [r["prompt"] + " " + r["answer"] for r in records] * 5
    tok = Tokenizer.train_bpe(texts, vocab_size=2048, split_digits=True, min_frequency=1)
    config = ModelConfig(vocab_size=2048, n_layer=4, n_head=4, d_model=128, max_seq_len=128,
                         pos="learned", norm="layernorm", mlp="gelu", bias=False)  # fmt: skip
    lm = LM.from_config(config, tokenizer=tok, seed=0)
    prompts = [prompt_ids(r, tok) for r in records[:PROMPTS]]
    return lm, prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = reference_module()
    lm, prompts = setup()
    model, tok = lm.model.eval(), lm.tokenizer
    stop = default_stop_ids(tok)
    rollouts = RolloutEngine(model, tok, NEW_TOKENS, TEMPERATURE, stop_ids=stop)
    rows = [p for p in prompts for _ in range(GROUP)]

    def old(seed: int) -> int:
        params = GenerationParams(NEW_TOKENS, TEMPERATURE, seed=seed)
        with torch.no_grad():
            return sum(map(len, ref.generate(model, rows, params, stop)))

    def new(seed: int) -> int:
        with torch.no_grad():
            return sum(map(len, rollouts.generate(prompts, GROUP, seed)))

    def timed(fn, seed: int) -> float:
        start = time.perf_counter()
        tokens = fn(seed)
        return tokens / (time.perf_counter() - start)

    widths = sorted(len(p) for p in prompts)
    print(f"{PROMPTS} prompts ({widths[0]}-{widths[-1]} tokens) x {GROUP} samples, "
          f"{NEW_TOKENS} new tokens, {model.num_parameters():,} parameters, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    for fn in (old, new):  # warm-up
        fn(0)
    rates: dict[str, list[float]] = {"old": [], "new": []}
    pair = [("old", old), ("new", new)]
    for i in range(args.repeats):
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            rates[name].append(timed(fn, i + 1))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"old (reference generate loop, as rollouts used it at 435f4d3): {med['old']:,.0f} tok/s")
    print(f"new (engine: one prefill per group, shared prefix):          {med['new']:,.0f} tok/s")
    print(f"ratio new/old: {med['new'] / med['old']:.2f}x (median of {args.repeats}, alternating)")


if __name__ == "__main__":
    main()
