"""Attention time and peak memory vs sequence length: explicit softmax, SDPA, linear attention.

Quadratic vs linear: the explicit kernel materialises the T×T score matrix, SDPA (flash /
memory-efficient kernels) avoids storing it but still does O(T²) work, causal linear attention
does O(T) work with a fixed-size state. Each (kernel, T) runs in a fresh process so its peak
RSS (CPU) or peak CUDA memory is its own; time is the median of 3 forward passes.

    python benchmarks/bench_attention.py [--lengths 256 512 1024 2048 4096] [--device cpu]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import time


def measure(kind: str, length: int, device: str, heads: int, head_dim: int, queue) -> None:
    import torch

    from lmforge.model.attention import explicit_attention, sdpa_attention
    from lmforge.model.linear_attention import build_feature_map, causal_linear_attention

    torch.set_num_threads(1)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, length, head_dim, device=device) for _ in range(3))
    phi = build_feature_map("elu", head_dim)
    run = {
        "explicit": lambda: explicit_attention(q, k, v, is_causal=True),
        "sdpa": lambda: sdpa_attention(q, k, v, is_causal=True),
        "linear": lambda: causal_linear_attention(phi(q), phi(k), v)[0],
    }[kind]
    with torch.no_grad():
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if device == "cuda":
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    queue.put((statistics.median(times), peak))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head_dim", type=int, default=64)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    kinds = ("explicit", "sdpa", "linear")
    print(f"B=1 H={args.heads} d_head={args.head_dim} causal, forward only, device {args.device}")
    print(f"{'T':>6} " + " ".join(f"{k + ' ms':>12} {k + ' MiB':>12}" for k in kinds)
          + f" {'explicit/linear time':>22}")  # fmt: skip
    for length in args.lengths:
        row = {}
        for kind in kinds:
            queue = ctx.Queue()
            proc = ctx.Process(target=measure, args=(kind, length, args.device, args.heads,
                                                     args.head_dim, queue))  # fmt: skip
            proc.start()
            row[kind] = queue.get()
            proc.join()
        cells = " ".join(f"{row[k][0] * 1e3:>12.1f} {row[k][1]:>12.1f}" for k in kinds)
        print(f"{length:>6} {cells} {row['explicit'][0] / row['linear'][0]:>22.2f}")


if __name__ == "__main__":
    main()
