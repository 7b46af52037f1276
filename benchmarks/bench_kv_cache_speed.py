"""What the KV cache buys: 512 generated tokens with vs without it, and per-token latency at a
1,024-token context vs a 64-token one (with the cache, a step's cost should barely grow).

    python benchmarks/bench_kv_cache_speed.py

Targets: cached >= 5x faster over 512 tokens; latency(1024) / latency(64) <= 1.5. Median of 3,
alternating runs, on a ~10M-parameter Llama-style model (random weights).
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from pathlib import Path

import torch

from lmforge.infer.engine import Engine, GenerationParams
from lmforge.lm import LM
from lmforge.model.config import ModelConfig

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "infer" / "reference_generate.py"


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    torch.manual_seed(0)
    config = ModelConfig.from_preset("llama-mini", vocab_size=4096, max_seq_len=2048, n_layer=4)
    lm = LM.from_config(config, seed=0)
    prompt = [[1, 2, 3, 4]]
    # without the cache: the plain reference loop that reruns the whole sequence every token
    spec = importlib.util.spec_from_file_location("reference_generate", REFERENCE)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    uncached = GenerationParams(max_new_tokens=512, temperature=0.0)
    gen = lambda cache: (  # noqa: E731
        (lambda: lm.generate(prompt, 512, temperature=0.0, eos_ids=[])) if cache else
        (lambda: reference.generate(lm.model, prompt, uncached, use_cache=False))
    )  # fmt: skip
    with_cache, without = [], []
    for _ in range(3):
        with_cache.append(seconds(gen(True)))
        without.append(seconds(gen(False)))
    speedup = statistics.median(without) / statistics.median(with_cache)
    print(f"512 tokens: with cache {statistics.median(with_cache):.2f}s, without "
          f"{statistics.median(without):.2f}s -> {speedup:.1f}x (target >= 5x)")  # fmt: skip

    engine = Engine.from_lm(lm, max_batch=1)
    params = GenerationParams(max_new_tokens=33, temperature=0.0, stop_token_ids=[])

    def per_token(context: int) -> float:
        ids = torch.randint(0, 4096, (context,)).tolist()
        engine.generate([ids], GenerationParams(max_new_tokens=1, temperature=0.0))
        t0 = time.perf_counter()
        first = None
        for _out in engine.stream(ids, params):
            if first is None:  # exclude the prefill: time only decode steps
                first = time.perf_counter()
        return (time.perf_counter() - first) / (params.max_new_tokens - 1) if first else t0

    short, long = [], []
    for _ in range(3):
        short.append(per_token(64))
        long.append(per_token(1024))
    ratio = statistics.median(long) / statistics.median(short)
    print(f"per-token decode latency: {statistics.median(short) * 1e3:.2f} ms at 64 tokens of "
          f"context, {statistics.median(long) * 1e3:.2f} ms at 1024 -> {ratio:.2f}x "
          "(target <= 1.5x)")  # fmt: skip
    print("note: shared, loaded 2-core machine; ratios are what to compare")


if __name__ == "__main__":
    main()
