"""Position information: learned and sinusoidal absolute embeddings, and rotary embeddings (RoPE).

Absolute embeddings are added to the token embeddings; RoPE rotates queries and keys inside
attention. Every module takes `positions` (LongTensor [T] shared by the batch, or [B, T] when
left-padded rows start at different offsets), so cached decoding and padding need no special case.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmforge.errors import ConfigError


def sinusoidal_table(n_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(...): shape [n_positions, dim]."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]
    freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table.float()


class LearnedPositions(nn.Module):
    """nanoGPT's `wpe`: one trained vector per absolute position."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(max_seq_len, dim))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.weight[positions]


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal table (Vaswani et al.), stored as a non-persistent buffer."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__()
        self.max_seq_len, self.dim = max_seq_len, dim
        self.register_buffer("table", torch.empty(max_seq_len, dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the table, e.g. after building the model on the meta device."""
        self.table = sinusoidal_table(self.max_seq_len, self.dim).to(self.table.device)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions]


def rope_inv_freq(
    head_dim: int, base: float, scaling: dict | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies base^(-2k/d) for each rotated plane, and the attention scale factor.

    `scaling` follows Hugging Face's `rope_scaling` dict. Here: none/"default" and "linear"
    (position interpolation, theta = (i/s) * alpha_k).
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float(), 1.0
    raise ConfigError(f"unknown rope_scaling type {kind!r}; supported: default, linear")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables and the rotation applied to queries and keys.

    Two pairings exist in the wild: `interleaved` rotates (x0, x1), (x2, x3), ... (the RoFormer
    paper and the seed notes); the default rotates (x_i, x_{i+d/2}) ("rotate_half", used by
    Hugging Face Llama checkpoints). They are the same function up to a permutation of the
    head dimensions, so this flag is the one place the layout difference is handled.
    """

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        base: float = 10000.0,
        interleaved: bool = False,
        scaling: dict | None = None,
    ):
        super().__init__()
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, base
        self.interleaved, self.scaling = interleaved, scaling
        rope_inv_freq(head_dim, base, scaling)  # validate the scaling config eagerly
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the cos/sin tables, e.g. after building the model on the meta device."""
        inv_freq, mscale = rope_inv_freq(self.head_dim, self.base, self.scaling)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), inv_freq)
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat([angles, angles], dim=-1)
        device = self.cos.device
        self.cos, self.sin = (angles.cos() * mscale).to(device), (angles.sin() * mscale).to(device)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos/sin for `positions`, shaped to broadcast against [B, H, T, head_dim]."""
        cos, sin = self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        if positions.dim() == 2:  # per-row positions [B, T] -> [B, 1, T, D]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        else:
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def sinusoid_rotation(omega: float, k: int) -> torch.Tensor:
    """R(k) with PE(p + k) = R(k) PE(p) for one [sin, cos] pair of frequency omega (SPEC §3)."""
    c, s = math.cos(omega * k), math.sin(omega * k)
    return torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
