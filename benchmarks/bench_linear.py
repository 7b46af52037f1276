"""fp32 linear layers on the CPU: torch's kernel (F.linear: its BLAS, MKL on x86-64 wheels)
against lmforge's `Linear` (model/linear.py: oneDNN), at SmolLM2-135M's shapes, forward alone
(8 rows: a decode step of 8 sequences) and forward + backward (2,048 rows: a training batch).

Both run on the same tensors, alternating, `--repeats` times each; the median is reported, as
GFLOP/s (2·M·K·N per product; a backward is two products). The recorded table is
`linear_kernels` in docs/benchmarks.md.

`--decode` times instead every product of one SmolLM2 decode step at 8 rows — 30 layers' own
weights and the LM head, 0.54 GB of fp32 read once per step, as the engine reads them (one
layer's weights alone would sit in the cache between calls) — by torch's F.linear, oneDNN
(`Linear` in training) and lmforge's dense GEMV (`Linear.gemv`, what the engine's copy of the
model runs: infer/native/dense_matmul.cpp), alternating; recorded as `dense_matmul`.

  python benchmarks/bench_linear.py [--repeats 5] [--threads 1] [--decode]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from lmforge.model.linear import Linear, onednn_available

# (name, in_features, out_features): SmolLM2-135M's layers (fused q/k/v as lmforge holds it)
SHAPES = [("qkv", 576, 960), ("gate / up", 576, 1536), ("down", 1536, 576),
          ("LM head", 576, 49152)]  # fmt: skip


def call_seconds(layer, x: torch.Tensor, grad: torch.Tensor | None) -> float:
    """Seconds of one call of `layer` on x (with the backward of `grad` when given)."""
    t0 = time.perf_counter()
    if grad is None:
        with torch.no_grad():
            layer(x)
    else:
        layer(x).backward(grad)
    return time.perf_counter() - t0


def compare(k: int, n: int, m: int, backward: bool, repeats: int) -> dict[str, float]:
    """Median seconds per call of torch's F.linear and lmforge's Linear on the same weights."""
    ours = Linear(k, n, bias=False)
    sides = {"torch": lambda x: F.linear(x, ours.weight), "lmforge": ours}
    x = torch.randn(m, k, requires_grad=backward)
    grad = torch.randn(m, n) if backward else None
    times: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(repeats + 1):  # the first round warms up
        for side, layer in sides.items():
            spent = call_seconds(layer, x, grad)
            if i:
                times[side].append(spent)
    return {side: statistics.median(v) for side, v in times.items()}


N_LAYERS, DECODE_ROWS = 30, 8  # SmolLM2-135M's blocks; 8 sequences decoding


def decode_step(args) -> None:
    """Seconds per decode step's products at 8 rows by each kernel; record `dense_matmul`."""
    from results import record

    from lmforge.infer.cpu_kernels import native_kernels

    native = native_kernels()
    if native is None or not onednn_available():
        raise SystemExit("--decode needs lmforge's native kernels and torch's oneDNN linear")
    load_start = os.getloadavg()[0]
    g = torch.Generator().manual_seed(0)
    # (in, out) of each block's qkv, o, gate, up and down
    per_block = [(576, 960), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
    shapes = per_block * N_LAYERS + [(576, 49152)]  # + the LM head
    weights = [torch.randn(n, k, generator=g) for k, n in shapes]
    inputs = {k: torch.randn(DECODE_ROWS, k, generator=g) for k in {w.shape[1] for w in weights}}
    kernels = {"torch F.linear (MKL)": lambda x, w: F.linear(x, w),
               "oneDNN (lmforge Linear)": lambda x, w: torch.ops.mkldnn._linear_pointwise(
                   x, w, None, "none", [], ""),
               f"lmforge dense GEMV ({native.variant})": native.dense_matmul}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in kernels}
    with torch.no_grad():
        for i in range(args.repeats + 1):  # the first round warms up
            for name, kernel in kernels.items():
                t0 = time.perf_counter()
                for w in weights:
                    kernel(inputs[w.shape[1]], w)
                if i:
                    times[name].append(time.perf_counter() - t0)
    gigabytes = sum(w.numel() for w in weights) * 4 / 1e9
    base = statistics.median(times["oneDNN (lmforge Linear)"])
    rows = []
    for name, spent in times.items():
        med = statistics.median(spent)
        rows.append([name, f"{1000 * med:.1f}", f"{gigabytes / med:.1f}", f"{base / med:.2f}"])
        print(rows[-1], flush=True)
    record("dense_matmul", "fp32 products of one SmolLM2 decode step at 8 rows: per kernel",
           ["kernel", "ms per step", "GB/s of weights", "speed-up vs oneDNN"], rows,
           notes=f"Every Linear of SmolLM2-135M's decode step ({N_LAYERS} x q/k/v fused, o, "
                 f"gate, up, down, and the 49,152-row LM head; {gigabytes:.2f} GB of fp32 "
                 f"weights, each its own tensor) times {DECODE_ROWS} rows of x, torch "
                 f"{torch.__version__}, alternating, median of {args.repeats} steps each after "
                 f"one warm-up, {args.threads} thread(s). Host load average {load_start:.1f} at "
                 f"the start, {os.getloadavg()[0]:.1f} at the end (a shared machine: only "
                 "ratios mean anything).",
           command=f"python benchmarks/bench_linear.py --decode --repeats {args.repeats}",
           )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--decode",
        action="store_true",
        help="every product of a SmolLM2 decode step at 8 rows, per kernel",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode:
        decode_step(args)
        return
    if not onednn_available():
        raise SystemExit(
            "this torch has no oneDNN linear (torch.backends.mkldnn): nothing to compare"
        )
    from results import record

    load_start = os.getloadavg()[0]
    rows = []
    for name, k, n in SHAPES:
        for m, backward in ((8, False), (2048, True)):
            med = compare(k, n, m, backward, args.repeats)
            flop = 2 * m * k * n * (3 if backward else 1)
            rows.append([name, f"{k} x {n}", m, "forward + backward" if backward else "forward",
                         f"{flop / med['torch'] / 1e9:.0f}", f"{flop / med['lmforge'] / 1e9:.0f}",
                         f"{med['torch'] / med['lmforge']:.2f}"])  # fmt: skip
            print(rows[-1], flush=True)
    record("linear_kernels", "fp32 linear layers on a CPU: torch's F.linear vs lmforge's Linear",
           ["layer", "in x out", "rows", "pass", "torch GFLOP/s", "lmforge GFLOP/s",
            "speed-up"], rows,
           notes=f"torch {torch.__version__}: F.linear calls its BLAS (MKL); lmforge's Linear "
                 "(model/linear.py) calls oneDNN (torch.ops.mkldnn._linear_pointwise) forward "
                 "and for both backward products. Same fp32 tensors, alternating, median of "
                 f"{args.repeats} calls each after one warm-up, {args.threads} thread(s). Host "
                 f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the "
                 "end (a shared machine: only the ratio within a row means anything).")  # fmt: skip


if __name__ == "__main__":
    main()
