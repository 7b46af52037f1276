"""fp32 linear layers on the CPU: torch's kernel (F.linear: its BLAS, MKL on x86-64 wheels)
against lmforge's `Linear` (model/linear.py: oneDNN), at SmolLM2-135M's shapes, forward alone
(8 rows: a decode step of 8 sequences) and forward + backward (2,048 rows: a training batch).

Both run on the same tensors, alternating, `--repeats` times each; the median is reported, as
GFLOP/s (2·M·K·N per product; a backward is two products). The recorded table is
`linear_kernels` in docs/benchmarks.md.

  python benchmarks/bench_linear.py [--repeats 5] [--threads 1]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
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
