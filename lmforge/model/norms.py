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


class RMSNorm(nn.Module):
    """RMSNorm: x / sqrt(mean(x^2) + eps) * gamma, eps inside the root, no mean, no beta."""

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight.float()).to(x.dtype)


class BatchNorm(nn.Module):
    """BatchNorm (SPEC §4, for completeness; sequence models use LayerNorm/RMSNorm because batch
    statistics mix examples and break with small or padded batches).

    Normalises each channel (dim 1) over the batch and every other dim with the biased variance;
    keeps running mean / unbiased variance (momentum 0.1) for eval, like torch.nn.BatchNorm*d.
    `spatial_dims`: 1 accepts [B, C] or [B, C, L]; 2 accepts [B, C, H, W].
    """

    def __init__(self, num_features: int, spatial_dims: int = 1, eps: float = 1e-5,
                 momentum: float = 0.1):  # fmt: skip
        super().__init__()
        self.spatial_dims, self.eps, self.momentum = spatial_dims, eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        allowed = (2, 3) if self.spatial_dims == 1 else (4,)
        if x.dim() not in allowed:
            raise ValueError(
                f"BatchNorm{self.spatial_dims}d expects {allowed}-D input, got {x.dim()}"
            )
        dims = [0, *range(2, x.dim())]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        x32 = x.float()
        if self.training:
            mean, var = x32.mean(dims), x32.var(dims, unbiased=False)
            n = x32.numel() / x32.shape[1]
            with torch.no_grad():
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var * n / max(n - 1, 1), self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        out = (x32 - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return (out * self.weight.view(shape) + self.bias.view(shape)).to(x.dtype)


def BatchNorm1d(num_features: int, **kw) -> BatchNorm:  # noqa: N802 (mirrors torch's name)
    return BatchNorm(num_features, spatial_dims=1, **kw)


def BatchNorm2d(num_features: int, **kw) -> BatchNorm:  # noqa: N802
    return BatchNorm(num_features, spatial_dims=2, **kw)


NORM_CLASSES: dict[str, type[nn.Module]] = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


def build_norm(kind: str, dim: int, eps: float, bias: bool) -> nn.Module:
    return NORM_CLASSES[kind](dim, eps=eps, bias=bias)
