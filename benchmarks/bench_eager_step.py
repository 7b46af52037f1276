"""The eager decode step's host overhead: Python calls per step and CPU time per token, batch 1,
one thread, for two checkouts of lmforge run alternately (before / after a change).

bench_generate.py's model shape (a 32M-parameter Llama: vocab 8192, d_model 512, 8 layers, 8 heads,
4 KV heads, d_ff 1376), random weights, int8 weights with fp32 activations (lmforge's native
kernels where they build), eager (no --compile), greedy, 200 new tokens after a 16-token prompt.
Each run is its own process, the sides in ABBA order; the figure is the process (CPU) time per
token, median of three passes, which a busy shared host disturbs less than wall time; the table
gives the median over the runs of each side.

    python benchmarks/bench_eager_step.py --before /tmp/old_checkout --after . [--runs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import collections, json, sys, time, torch
torch.set_num_threads(1)
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
cfg = ModelConfig(vocab_size=8192, d_model=512, n_layer=8, n_head=8, n_kv_head=4, d_ff=1376,
                  max_seq_len=512, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
engine = Engine(LM.from_config(cfg, seed=0).model, None, max_batch=1, quantize="int8",
                dtype="float32", eos_ids=[])
greedy = GenerationParams(max_new_tokens=200, temperature=0, stop_token_ids=[])
calls = [0]
def count(frame, event, arg):
    calls[0] += event in ("call", "c_call")
per_token = []
with torch.inference_mode():
    for attempt in range(4):
        engine.add_request(list(range(1, 17)), greedy)
        engine.step()  # the prefill
        if attempt == 0:  # warm-up pass, and the calls of one decode step
            engine.step()
            sys.setprofile(count); engine.step(); sys.setprofile(None)
        began, made = time.process_time(), 0
        while engine.has_work():
            made += sum(len(o.token_ids) for o in engine.step())
        if attempt:
            per_token.append((time.process_time() - began) / made * 1e3)
print(json.dumps({"calls": calls[0], "ms": sorted(per_token)[1]}))
"""


def run(root: str) -> dict:
    """One process over the lmforge under `root` (its working directory too: `python -c` puts
    the working directory first on sys.path)."""
    root = os.path.abspath(root)
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=root, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="root of the earlier checkout")
    ap.add_argument("--after", default=".", help="root of the later checkout")
    ap.add_argument("--runs", type=int, default=4, help="processes per side, alternating")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    sides = {"before": [], "after": []}
    loads = []
    for r in range(args.runs):
        for side in list(sides)[:: 1 if r % 2 == 0 else -1]:  # ABBA: no side always first
            sides[side].append(run(getattr(args, side)))
            loads.append(os.getloadavg()[0])
            print(side, sides[side][-1], f"load {loads[-1]:.1f}", flush=True)
    rows = [[side, got[0]["calls"], round(statistics.median(g["ms"] for g in got), 3),
             " ".join(f"{g['ms']:.2f}" for g in got)] for side, got in sides.items()]  # fmt: skip
    ratio = rows[1][2] / rows[0][2]
    print(f"after / before: {ratio:.3f} CPU time per token")
    if args.no_record:
        return
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.results import record

    record("eager_step_overhead", "Eager decode step, batch 1, 1 thread: host overhead",
           ["checkout", "Python calls per step", "CPU ms per token (median)", "runs"], rows,
           notes=f"bench_generate.py's 32M Llama shape, int8 weights, fp32 activations, "
                 f"eager, greedy, 200 tokens; each run a process, alternating before / after; "
                 f"after / before = {ratio:.3f}. Host load (1 min) while measuring: "
                 f"{min(loads):.1f}-{max(loads):.1f} on a shared 2-core machine.")  # fmt: skip


if __name__ == "__main__":
    main()
