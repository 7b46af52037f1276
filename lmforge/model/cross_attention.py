"""Cross-attention (Vaswani et al. 2017, §3.2.3): queries from one sequence, keys/values from
another ("memory": the encoder output in a translation model, the input in a Perceiver). With memory
= x it is plain bidirectional self-attention. Used by the seq2seq decoder; the Perceiver latent
block built on it is a specification exhibit in tests/model/spec_exhibits.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
