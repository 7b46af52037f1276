"""Specification exhibits: formulas built for completeness that nothing in lmforge uses, kept
here with the tests that check them (BatchNorm against torch, the Perceiver latent block, the FP8
scaled GEMM). Tests get this module through the `spec_exhibits` fixture (tests/model/conftest.py).

Perceiver latent block (Jaegle et al. 2021, "Perceiver"): M learned latents Z read an input X of
any length L, Q = Z W_q, K = X W_k, V = X W_v, so the cost is O(M·L), not O(L²), and the output
is B×M×d:

    z = Z;  z = z + CrossAttn(N(z) <- N(x));  z = z + SelfAttn(N(z));  z = z + FFN(N(z))   (pre-LN)
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.model.cross_attention import CrossAttention
from lmforge.model.feedforward import build_mlp
from lmforge.model.norms import LayerNorm
from lmforge.model.precision import has_fp8_matmul, quantize_fp8


class BatchNorm(nn.Module):
    """BatchNorm (Ioffe & Szegedy 2015; for completeness: sequence models use LayerNorm/RMSNorm
    because batch statistics mix examples and break with small or padded batches).

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


class LatentBlock(nn.Module):
    """Perceiver block: M learnable latents read an input of any length; output [B, M, d]."""

    def __init__(
        self, d_model: int, n_head: int, n_latents: int, d_input: int | None = None,
        d_ff: int | None = None, mlp: str = "gelu", dropout: float = 0.0,
    ):  # fmt: skip
        super().__init__()
        self.latents = nn.Parameter(torch.randn(n_latents, d_model) * 0.02)
        self.cross_norm_z = LayerNorm(d_model)
        self.cross_norm_x = LayerNorm(d_input or d_model)
        self.cross = CrossAttention(d_model, n_head, d_input, dropout=dropout)
        self.self_norm = LayerNorm(d_model)
        self.self_attn = CrossAttention(d_model, n_head, dropout=dropout)
        self.mlp_norm = LayerNorm(d_model)
        self.mlp = build_mlp(mlp, d_model, d_ff or 4 * d_model, True, dropout)

    def forward(self, x: torch.Tensor, x_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, d_input], x_mask [B, L] (1 = real) -> latents [B, M, d_model]."""
        z = self.latents.expand(x.shape[0], -1, -1)
        mask = None if x_mask is None else x_mask.bool()[:, None, None, :]
        z = z + self.cross(self.cross_norm_z(z), self.cross_norm_x(x), mask=mask)
        z = z + self.self_attn(self.self_norm(z))
        return z + self.mlp(self.mlp_norm(z))


def fp8_matmul_reference(x: torch.Tensor, w: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """x [N, K] @ w[M, K]ᵀ through FP8: O = GEMM(X·S_X, W·S_W) / (S_X·S_W). Per-tensor scale for
    x, per-output-channel scale for w; accumulation in fp32 (what FP8 tensor cores do)."""
    qx, sx = quantize_fp8(x, fmt)
    qw, sw = quantize_fp8(w, fmt, dim=0)  # sw [M, 1]
    return (qx.float() @ qw.float().t()) / (sx * sw.t())


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """x [N, K] @ w[M, K]ᵀ in FP8 E4M3 on hardware that has it, else the reference path.

    torch._scaled_mm takes the inverse scales (it multiplies by them) and wants the second
    operand column-major, which w.t() of a row-major w already is."""
    if not (x.is_cuda and has_fp8_matmul(x.device)):
        return fp8_matmul_reference(x, w).to(out_dtype)
    qx, sx = quantize_fp8(x)
    qw, sw = quantize_fp8(w, dim=0)
    return torch._scaled_mm(
        qx, qw.t(), scale_a=(1 / sx).reshape(1, 1), scale_b=(1 / sw).reshape(1, -1),
        out_dtype=out_dtype,
    )  # fmt: skip
