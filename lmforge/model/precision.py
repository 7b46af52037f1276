"""Number formats and FP8 scaling (Micikevicius et al. 2022, "FP8 Formats for Deep Learning").

The dtype table is read from torch.finfo / torch.iinfo rather than typed in, so it cannot drift from
what the hardware kernels do (IEEE 754 and the FP8 paper: fp16 max 65504; E4M3fn max 448, smallest
normal 2^-6; E5M2 max 57344, smallest normal 2^-14; int4 -8..7, which torch has no iinfo for).

FP8 has so little range that tensors are scaled before the cast: x_s = x·S with S = fmax/amax(x),
per tensor or per output channel, kept in fp32. A matmul of two scaled tensors is unscaled after:
O = GEMM(W·S_W, X·S_X) / (S_X·S_W). The recipe uses E4M3 (more precision) for weights and
activations and E5M2 (more range) for gradients. `has_fp8_matmul` says whether this machine has FP8
units (torch._scaled_mm); the scaled-GEMM reference is a specification exhibit in the tests.
"""

from __future__ import annotations

import torch

FLOAT_FORMATS = {
    "float32": torch.float32,
    "tf32": torch.float32,  # same storage; matmul inputs rounded to 10 mantissa bits on GPU
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
INT_FORMATS = {"int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8}
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def dtype_table() -> list[dict]:
    """One row per format: bits, largest value, smallest normal, machine epsilon (floats)."""
    rows = []
    for name, dtype in FLOAT_FORMATS.items():
        info = torch.finfo(dtype)
        eps = 2.0**-10 if name == "tf32" else info.eps
        rows.append(dict(name=name, kind="float", bits=info.bits, max=info.max,
                         min=info.min, smallest_normal=info.smallest_normal, eps=eps))  # fmt: skip
    for name, dtype in INT_FORMATS.items():
        info = torch.iinfo(dtype)
        rows.append(dict(name=name, kind="int", bits=info.bits, max=info.max, min=info.min))
    rows.append(dict(name="int4", kind="int", bits=4, max=7, min=-8))  # no torch.iinfo
    return rows


def fp8_scale(x: torch.Tensor, fmt: str = "e4m3", dim: int | None = None) -> torch.Tensor:
    """S (fp32) such that max|x·S| = the format's max: one scalar, or one per slice along `dim`
    (per-channel: dim=0 for a weight [out, in] gives one scale per output channel)."""
    fmax = torch.finfo(FP8_FORMATS[fmt]).max
    x = x.detach().float()
    if dim is None:
        amax = x.abs().amax()
    else:
        reduce = [d for d in range(x.dim()) if d != dim % x.dim()]
        amax = x.abs().amax(dim=reduce, keepdim=True)
    return fmax / amax.clamp(min=1e-12)


def quantize_fp8(x: torch.Tensor, fmt: str = "e4m3", dim: int | None = None):
    """(x·S cast to FP8, S). Values stay within range, so nothing saturates."""
    scale = fp8_scale(x, fmt, dim)
    fmax = torch.finfo(FP8_FORMATS[fmt]).max
    return (x.float() * scale).clamp(-fmax, fmax).to(FP8_FORMATS[fmt]), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Back to fp32: x ≈ q / S."""
    return q.float() / scale


def fp8_round_trip(x: torch.Tensor, fmt: str = "e4m3", dim: int | None = None) -> torch.Tensor:
    return dequantize_fp8(*quantize_fp8(x, fmt, dim)).to(x.dtype)


def has_fp8_matmul(device: torch.device | str | None = None) -> bool:
    """FP8 tensor cores: NVIDIA compute capability 8.9 (Ada) or newer."""
    if not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)
