"""Cross-attention and the seed's latent (Perceiver-style) attention block (SPEC §2).

Cross-attention takes queries from one sequence and keys/values from another ("memory": the
encoder output in a translation model, the input in a Perceiver). With memory = x it is plain
bidirectional self-attention. The latent block compresses an input of any length L into M
learned latent vectors: Q = Z W_q, K = X W_k, V = X W_v, so the cost is O(M·L), not O(L²), and the
output is B×M×d whatever L is:

    z = Z;  z = z + CrossAttn(N(z) <- N(x));  z = z + SelfAttn(N(z));  z = z + FFN(N(z))   (pre-LN)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.feedforward import build_mlp
from lmforge.model.norms import LayerNorm


class CrossAttention(nn.Module):
    """Multi-head attention: queries from x [B,T,d], keys/values from memory [B,S,d_memory]."""

    def __init__(
        self, d_model: int, n_head: int, d_memory: int | None = None, bias: bool = True,
        dropout: float = 0.0,
    ):  # fmt: skip
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_head ({n_head})")
        self.n_head, self.head_dim, self.dropout = n_head, d_model // n_head, dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.kv_proj = nn.Linear(d_memory or d_model, 2 * d_model, bias=bias)
        self.o_proj = nn.Linear(d_model, d_model, bias=bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.n_head, self.head_dim).transpose(1, 2)

    def memory_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the memory [B,H,S,Dh]: computed once, reused at every decode step."""
        k, v = self.kv_proj(memory).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """mask: bool, True = attend, broadcastable to [B,H,T,S] (e.g. memory padding
        [B,1,1,S]). kv: precomputed `memory_kv` (then memory is not needed)."""
        b, t, _ = x.shape
        if kv is None:
            kv = self.memory_kv(x if memory is None else memory)
        q = self._heads(self.q_proj(x))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(
            q, kv[0], kv[1], attn_mask=mask, is_causal=is_causal, dropout_p=dropout
        )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


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
