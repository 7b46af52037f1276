"""Normalisation layers. Both compute in fp32 and cast back, so bf16/fp16 training stays stable."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """LayerNorm with biased variance: (x - mean) / sqrt(var + eps) * gamma (+ beta if bias)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        out = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), bias, self.eps)
        return out.to(x.dtype)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what RMSNorm.kernel takes


class RMSNorm(nn.Module):
    """RMSNorm: x / sqrt(mean(x^2) + eps) * gamma, eps inside the root, no mean, no beta."""

    # A fused kernel (x, weight, eps) -> torch.rms_norm's result for fp32 / bf16 x and weights
    # on a CPU, or None. Inference sets lmforge's native one (infer/quantize.py
    # inference_model): torch runs the norm as six ops, several times the cost of one pass at a
    # decode step's few rows.
    kernel = None

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's op computes x * rsqrt(mean(x^2) + eps) * gamma; fp32 inputs skip the casts
        # and call it without F.rms_norm's Python wrapper (at every norm of every decoded token)
        w = self.weight
        if self.kernel is not None and x.dtype in _KERNEL_DTYPES and w.dtype in _KERNEL_DTYPES:
            if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
                return self.kernel(x, w, self.eps)
        if x.dtype == torch.float32 and w.dtype == torch.float32:
            return torch.rms_norm(x, w.shape, w, self.eps)
        return F.rms_norm(x.float(), w.shape, w.float(), self.eps).to(x.dtype)


NORM_CLASSES: dict[str, type[nn.Module]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


def build_norm(config) -> nn.Module:
    """The norm a ModelConfig names, over d_model."""
    return NORM_CLASSES[config.norm](config.d_model, eps=config.norm_eps, bias=config.bias)
