"""Multi-head Latent Attention (DeepSeek-V2, arXiv:2405.04434; DeepSeek-V3): a small KV cache by
low-rank joint compression of keys and values.

Each token is projected to one latent c = W_DKV x of `kv_lora_rank` dims (much smaller than
2·n_head·head_dim) plus one shared RoPE key k_R = RoPE(W_KR x) of `qk_rope_head_dim` dims. Per-head
keys and values are re-expanded from the latent: k_i = [W_UK c, k_R], v_i = W_UV c. Because RoPE
does not commute with W_UK, the position signal lives in the separate ("decoupled") k_R, and the
query is split the same way: q_i = [q_nope, RoPE(q_rope)]. The cache stores only (c, k_R):
(kv_lora_rank + qk_rope_head_dim) numbers per token per layer, shared by every head
(cache.LatentKVCache).

Names follow Hugging Face's DeepSeek-V2 config (kv_lora_rank, q_lora_rank, qk_rope_head_dim);
head_dim plays qk_nope_head_dim and v_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.model.attention import ATTENTION_KERNELS
from lmforge.model.norms import RMSNorm


class MultiHeadLatentAttention(nn.Module):
    """config attention="mla". Same call signature as CausalSelfAttention."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        h, d, r, c = config.n_head, config.head_dim, config.qk_rope_head_dim, config.kv_lora_rank
        self.n_head, self.head_dim, self.rope_dim, self.latent_dim = h, d, r, c
        bias = config.attention_bias
        if config.q_lora_rank:  # DeepSeek-V2 also compresses queries (saves activations only)
            self.q_down = nn.Linear(config.d_model, config.q_lora_rank, bias=bias)
            self.q_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
            self.q_up = nn.Linear(config.q_lora_rank, h * (d + r), bias=False)
        else:
            self.q_proj = nn.Linear(config.d_model, h * (d + r), bias=bias)
        self.kv_down = nn.Linear(config.d_model, c + r, bias=bias)  # [latent c, shared k_R]
        self.kv_norm = RMSNorm(c, config.norm_eps)
        self.kv_up = nn.Linear(c, h * 2 * d, bias=False)  # latent -> per-head [k_nope, v]
        self.o_proj = nn.Linear(h * d, config.d_model, bias=config.attention_out_bias)
        self.kernel = ATTENTION_KERNELS[config.attn_impl]
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_up(self.q_norm(self.q_down(x)))

    def forward(self, x, rope=None, rope_tables=None, mask=None, is_causal=True, cache=None):
        b, t, _ = x.shape
        h, d, r = self.n_head, self.head_dim, self.rope_dim
        q = self.queries(x).view(b, t, h, d + r).transpose(1, 2)
        q_nope, q_rope = q.split((d, r), dim=-1)
        latent, k_rope = self.kv_down(x).split((self.latent_dim, r), dim=-1)
        latent, k_rope = latent[:, None], k_rope[:, None]  # [B, 1, t, .]: one "head"
        if rope is not None:
            cos, sin = rope_tables
            q_rope, k_rope = rope.rotate(q_rope, cos, sin), rope.rotate(k_rope, cos, sin)
        if cache is not None:
            latent, k_rope = cache.update(self.layer_idx, latent, k_rope)
        s = latent.shape[2]
        kv = self.kv_up(self.kv_norm(latent[:, 0])).view(b, s, h, 2 * d).transpose(1, 2)
        k_nope, v = kv.split((d, d), dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(b, h, s, r)], dim=-1)
        dropout = self.dropout if self.training else 0.0
        y = self.kernel(q, k, v, mask=mask, is_causal=is_causal, dropout=dropout)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(b, t, -1)))
