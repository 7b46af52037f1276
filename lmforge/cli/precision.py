"""`lmforge precision`: the number-format table (from torch.finfo/iinfo), an FP8 check, and what
`--dtype auto` picks on this machine (the engine-backed commands' --dtype/--quantize options:
cli/generate.py's add_engine_args)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("precision", help="number formats: bits, range, smallest normal, "
                       "epsilon; FP8 round-trip error", description="Print the dtype table read "
                       "from torch.finfo/torch.iinfo, the relative error of an FP8 "
                       "per-tensor / per-channel round trip on random data, and the CPU features "
                       "and kernels --dtype auto chooses from.")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=run)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.6g}"


def run(args) -> int:
    import json

    import torch

    from lmforge.model.precision import dtype_table, fp8_round_trip, has_fp8_matmul

    rows = dtype_table()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ("name", "bits", "max", "min", "smallest_normal", "eps")
    print("".join(f"{c:>16}" for c in cols))
    for row in rows:
        print("".join(f"{_cell(row.get(c)) if c != 'name' else row[c]:>16}" for c in cols))
    torch.manual_seed(0)
    w = torch.randn(256, 256) * torch.logspace(-3, 1, 256)[:, None]  # channels of mixed scale
    print("\nFP8 round trip, worst per-channel relative error, channels spanning 1e-3..10:")
    for fmt in ("e4m3", "e5m2"):
        for label, dim in (("per-tensor", None), ("per-channel", 0)):
            err = ((fp8_round_trip(w, fmt, dim) - w).norm(dim=1) / w.norm(dim=1)).max()
            print(f"  {fmt} {label:<12} {err:.2e}")
    print(f"FP8 matmul on this machine: {'torch._scaled_mm' if has_fp8_matmul() else 'reference'}")
    from lmforge.infer.cpu_features import cpu_features
    from lmforge.infer.cpu_kernels import native_kernels, unavailable_reason
    from lmforge.infer.quantize import QUANTIZE_CHOICES, auto_dtype, kernel_plan

    chosen, why = auto_dtype("cpu")
    native = native_kernels()
    print(f"\nCPU: {cpu_features().summary()}")
    print(f"lmforge's kernels: {native.variant if native else f'none ({unavailable_reason()})'}")
    print(f"--dtype auto on this CPU: {str(chosen).removeprefix('torch.')} ({why})")
    modes = [(chosen, None), (torch.bfloat16, None)]
    modes += [(auto_dtype("cpu", quantize=q)[0], q) for q in QUANTIZE_CHOICES]
    for dtype, mode in dict.fromkeys(modes):  # the kernel each layer kind runs, per choice
        print(f"\n{mode or 'unquantised'}, {str(dtype).removeprefix('torch.')} activations:")
        for kind, kernel in kernel_plan(dtype, mode).items():
            print(f"  {kind:<26} {kernel}")
    return 0
