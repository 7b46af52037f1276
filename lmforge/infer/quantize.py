"""Inference precision: bf16 weights, and weight-only int8 quantisation for decoding.

Decoding one token reads every weight once, so on a CPU a small batch runs at memory bandwidth /
weight bytes: int8 weights read 4x fewer bytes than fp32, 2x fewer than bf16. Each output channel
of a Linear keeps one scale (symmetric, absmax / 127) and
`torch.ops.aten._weight_int8pack_mm` (the CPU kernel gpt-fast uses) multiplies bf16 activations by
the int8 weights and applies the scales. That kernel is a GEMV: with many rows (prefill, large
batches) a bf16 GEMM (AMX on recent Xeons) is several times faster, so those calls multiply by the
same int8 values held as bf16 (exact: |q| <= 127 fits bf16's 8-bit mantissa) and apply the scales
afterwards: the model computes the same quantised function at every batch size. That bf16 copy is
made on the first large call, so a batch-1-only user never pays its memory.

    model = to_inference_precision(model, dtype=torch.bfloat16, quantize="int8")
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError
from lmforge.model.positions import LearnedPositions


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight [N, K] -> (q int8 [N, K], scale fp32 [N])."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """A frozen nn.Linear with int8 weights and one scale per output channel (bf16 activations).

    Calls with fewer than `gemm_rows` rows use the int8 GEMV kernel; larger ones a bf16 GEMM.
    """

    gemm_rows = 8  # measured crossover on a Sapphire Rapids core (int8 GEMV vs bf16 AMX GEMM)

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight)
        self.register_buffer("weight_int8", q.contiguous())
        self.register_buffer("scale", scale.to(dtype))
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        self.register_buffer("bias", bias)
        self._gemm_weight: torch.Tensor | None = None  # q as bf16, made on first large call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out] (the decoder calls this directly: no module overhead)."""
        buffers = self._buffers  # plain dict lookups: nn.Module.__getattr__ is slow per token
        scale, bias = buffers["scale"], buffers["bias"]
        if x.dtype != scale.dtype:
            x = x.to(scale.dtype)
        if x.shape[0] < self.gemm_rows and x.device.type == "cpu":
            y = torch.ops.aten._weight_int8pack_mm(x, buffers["weight_int8"], scale)
        else:
            if self._gemm_weight is None or self._gemm_weight.device != x.device:
                self._gemm_weight = buffers["weight_int8"].to(scale.dtype)
            y = F.linear(x, self._gemm_weight) * scale
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def swap_linears(module: nn.Module, make) -> int:
    """Replace every nn.Linear under `module` by make(linear); returns how many were replaced."""
    count = 0
    for name, child in module.named_children():
        if type(child) is nn.Linear:
            setattr(module, name, make(child))
            count += 1
        else:
            count += swap_linears(child, make)
    return count


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZERS = {"int8": Int8Linear}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a name ('bfloat16', 'bf16', ...) or a dtype; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[name]


def to_inference_precision(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    quantize: str | None = None,
    copy_model: bool = True,
) -> nn.Module:
    """The model in `dtype` with its Linear layers quantised (`quantize`: None or 'int8').

    int8 defaults to bf16 activations: the CPU kernel is ~10x slower with fp32 ones. With
    copy_model the input is left untouched (the engine's caller may keep training it); a model
    already in the asked precision is returned as it is.
    """
    dtype = resolve_dtype(dtype)
    if quantize is not None and quantize not in QUANTIZERS:
        raise ConfigError(f"quantize must be one of {sorted(QUANTIZERS)} or None, got {quantize!r}")
    if quantize is None and dtype in (None, next(model.parameters()).dtype):
        return model
    if quantize is not None:
        dtype = dtype or torch.bfloat16
    if copy_model:
        model = copy.deepcopy(model)
    model = model.to(dtype).eval().requires_grad_(False)
    if quantize is not None:
        cls = QUANTIZERS[quantize]
        swap_linears(model, lambda linear: cls(linear, dtype))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights as stored (state_dict, shared tensors once; int8 counts 1 byte)."""
    tensors = {t.data_ptr(): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def decode_bytes(model: nn.Module) -> int:
    """Weight bytes one decoding step reads: everything but the token and position embedding
    tables, of which a token reads one row (a token table the LM head shares still counts)."""
    tables = [m.weight for m in model.modules() if isinstance(m, (nn.Embedding, LearnedPositions))]
    head = getattr(model, "lm_head", None)
    shared = getattr(getattr(head, "weight", None), "data_ptr", lambda: None)()
    skip = sum(t.numel() * t.element_size() for t in tables if t.data_ptr() != shared)
    return weight_bytes(model) - skip
