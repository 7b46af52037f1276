"""Candidate kernels for quantised Linears, per layer shape of SmolLM2-135M, on this CPU.

For each weight shape of the model (q/o 576x576, the fused k+v 576x384 and one of them 576x192,
gate/up 576x1536, down 1536x576, the LM head 576x49152) and each row count (1 = batch-1 decode,
128 = a prefill chunk), this times:

    fp32 / bf16        F.linear with the weight in that dtype
    int8 pack bf16     aten._weight_int8pack_mm, bf16 activations (the GEMV kernel we call)
    int8 pack fp32     the same kernel fed fp32 activations
    int8 ours          Int8Linear.matmul with fp32 activations (what --quantize int8 runs here)
    int8 dyn fbgemm    quantized.linear_dynamic: per-row int8 activations x int8 weights
    int8 _int_mm       torch._int_mm on per-row-quantised activations, then the two scales
    int4 pack bf16/fp32  aten._weight_int4pack_mm_for_cpu (group 32)
    int4 ours          Int4Linear.matmul with fp32 activations (what --quantize int4 runs here)
    int4 dyn           aten._dyn_quant_matmul_4bit (KleidiAI on Arm; a scalar reference on x86)
    int8 compiled      (--compiled) torch.compile of the dequantise-then-multiply expression

and prints microseconds per call, and for decode the % of the bandwidth bound: the weight bytes
a call must read / the copy bandwidth measured here (a 256 MiB copy, read + write), over the
measured time. Candidates run alternately in rounds (median of the rounds), so a machine shared
with other work slows every candidate alike; the ratios are what to read.

    python benchmarks/bench_quant_kernels.py [--threads 1] [--rows 1 128] [--compiled]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.infer.cpu_features import cpu_features
from lmforge.infer.int4_linear import Int4Linear, quantize_int4
from lmforge.infer.quantized_linear import Int8Linear, quantize_int8

SHAPES = [  # (name, in_features K, out_features N)
    ("q/o 576x576", 576, 576),
    ("k or v 576x192", 576, 192),
    ("k+v 576x384", 576, 384),
    ("gate/up 576x1536", 576, 1536),
    ("down 1536x576", 1536, 576),
    ("lm head 576x49152", 576, 49152),
]
SLOW_AT_PREFILL = ("int8 pack fp32", "int4 pack fp32", "int4 dyn")  # >10x fp32: skipped there


def bandwidth_gbs(mib: int = 256) -> float:
    """Best of 5 copies of a `mib`-MiB tensor, counting the read and the write."""
    src = torch.ones(mib * 2**18)
    dst = torch.empty_like(src)
    best = min(_time_once(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best / 1e9


def _time_once(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def candidates(k: int, n: int, rows: int, compiled: bool) -> dict[str, tuple[callable, int]]:
    """name -> (a call on fresh inputs, weight bytes it reads)."""
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False)
    w = linear.weight.detach()
    x = torch.randn(rows, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    q8, s8 = quantize_int8(w)
    s8b = s8.bfloat16()
    out = {
        "fp32": (lambda: F.linear(x, w), 4 * n * k),
        "bf16": (lambda: F.linear(xb, wb), 2 * n * k),
        "int8 pack bf16": (lambda: torch.ops.aten._weight_int8pack_mm(xb, q8, s8b), n * k),
        "int8 pack fp32": (lambda: torch.ops.aten._weight_int8pack_mm(x, q8, s8), n * k),
    }
    ours8 = Int8Linear(linear, torch.float32)
    out["int8 ours"] = (lambda: ours8.matmul(x), n * k)
    try:
        qw = torch.quantize_per_channel(w, s8.double(), torch.zeros(n, dtype=torch.long), 0,
                                        torch.qint8)  # fmt: skip
        packed = torch.ops.quantized.linear_prepack(qw, None)
        out["int8 dyn fbgemm"] = (lambda: torch.ops.quantized.linear_dynamic(x, packed), n * k)
    except (RuntimeError, AttributeError) as err:
        print(f"  (quantized.linear_dynamic unavailable: {str(err).splitlines()[0]})")
    q8t = q8.t().contiguous()

    def int_mm():
        sx = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
        xq = torch.round(x / sx).to(torch.int8)
        return torch._int_mm(xq, q8t) * sx * s8

    out["int8 _int_mm"] = (int_mm, n * k)
    q4, sc, zr = quantize_int4(w, 32)
    ours4 = Int4Linear(linear, torch.float32, 32)
    # torch's own packing (ours4 keeps the native kernel's layout where that kernel builds)
    p4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 1)
    sz = torch.stack([sc, zr], dim=-1).transpose(0, 1).contiguous()
    sz_b = sz.bfloat16()
    out["int4 pack bf16"] = (
        lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p4, 32, sz_b),
        n * k // 2,
    )
    out["int4 pack fp32"] = (
        lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4, 32, sz),
        n * k // 2,
    )
    out["int4 ours"] = (lambda: ours4.matmul(x), n * k // 2)
    try:  # symmetric codes, as the dynamic kernel expects (w = (q - 8) * scale)
        scale = w.view(n, -1, 32).abs().amax(-1).clamp(min=1e-12) / 7
        codes = (torch.round(w.view(n, -1, 32) / scale[..., None]) + 8).clamp(0, 15)
        codes = codes.to(torch.uint8).view(n, k)
        nib = (codes[:, ::2] | codes[:, 1::2] << 4).contiguous()
        dyn = torch.ops.aten._dyn_quant_pack_4bit_weight(nib, scale, None, 32, k, n)
        out["int4 dyn"] = (lambda: torch.ops.aten._dyn_quant_matmul_4bit(x, dyn, 32, k, n),
                           n * k // 2)  # fmt: skip
    except (RuntimeError, AttributeError) as err:
        print(f"  (_dyn_quant_matmul_4bit unavailable: {str(err).splitlines()[0]})")
    if compiled:
        qf = q8

        @torch.compile(dynamic=False)
        def deq_mm(x):
            return F.linear(x, qf.float()) * s8

        out["int8 compiled"] = (lambda: deq_mm(x), n * k)
    del q4, sc, zr
    return out


def measure(calls: dict, rounds: int, budget: float) -> dict[str, float]:
    """Median seconds per call of each candidate, candidates alternating within each round."""
    reps = {}
    for name, (fn, _) in calls.items():
        fn()  # warm up (and compile)
        one = max(_time_once(fn), 1e-6)
        reps[name] = max(1, min(200, int(budget / one)))
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (fn, _) in calls.items():
            t = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            times[name].append((time.perf_counter() - t) / reps[name])
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.03, help="seconds per candidate per round")
    ap.add_argument("--compiled", action="store_true", help="also torch.compile's dequant GEMM")
    ap.add_argument("--shapes", nargs="+", default=None, help="substrings of the shape names")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_features().summary()}; torch {torch.__version__}; {args.threads} thread(s)")
    bw = statistics.median(bandwidth_gbs() for _ in range(3))
    print(f"copy bandwidth {bw:.1f} GB/s (256 MiB tensor copy, read + write, median of 3)\n")
    shapes = [s for s in SHAPES if not args.shapes or any(p in s[0] for p in args.shapes)]
    with torch.inference_mode():
        for rows in args.rows:
            print(f"## {rows} row(s): us per call" + (" (% of the bandwidth bound)" if rows < 8
                                                      else " (GFLOP/s)"))  # fmt: skip
            for name, k, n in shapes:
                if rows >= 8 and n > 10000:
                    print(f"{name:<20} skipped: prefill runs the head on the last position only")
                    continue
                calls = candidates(k, n, rows, args.compiled)
                if rows >= 8:
                    calls = {c: v for c, v in calls.items() if c not in SLOW_AT_PREFILL}
                secs = measure(calls, args.rounds, args.budget)
                cells = []
                for c, s in secs.items():
                    extra = (f"{calls[c][1] / bw / 1e9 / s:.0%}" if rows < 8
                             else f"{2 * rows * n * k / s / 1e9:.0f}")  # fmt: skip
                    cells.append(f"{c} {s * 1e6:.0f} ({extra})")
                print(f"{name:<20} " + " | ".join(cells), flush=True)
            print()


if __name__ == "__main__":
    main()
