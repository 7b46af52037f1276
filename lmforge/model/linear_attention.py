"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs"): softmax replaced by a
feature map φ ≥ 0.

    attn_i = S_V φ(q_i) / (S_K φ(q_i) + ε),   S_V = Σ_j v_j φ(k_j)ᵀ,   S_K = Σ_j φ(k_j)ᵀ

Because φ(q)·φ(k) factorises, the sums over keys can be computed once (bidirectional) or as
running prefix sums (causal), so cost is linear in the sequence length and decoding needs only the
two sums: a recurrent state of fixed size per layer, O(1) per token (cache.LinearStateCache).

The causal kernel works in chunks: inside a chunk the masked quadratic form (cheap, C×C), across
chunks the carried state. Chunk size 1 is the pure recurrence; the result is the same for any C.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.attention import CausalSelfAttention

EPS = 1e-6


class RandomFeatures(nn.Module):
    """Positive random features (Performer's FAVOR+): φ(x) = exp(Wx' − |x'|²/2)/√m with
    x' = x/d^¼, so E[φ(q)·φ(k)] = exp(q·k/√d), the softmax kernel. The random Fourier (cos/sin)
    features approximate the same kernel but can go negative, which breaks the normaliser; these
    stay positive. W is a buffer saved with the weights, so a reloaded model computes the same."""

    def __init__(self, dim: int, n_features: int | None = None, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("proj", torch.randn(n_features or dim, dim, generator=gen))
        self.scale = dim**-0.25

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() * self.scale
        wx = x @ self.proj.t()
        return torch.exp(wx - 0.5 * x.pow(2).sum(-1, keepdim=True)) / math.sqrt(wx.shape[-1])


FEATURE_MAPS = {
    "elu": lambda x, d: F.elu(x) + 1.0,
    "relu": lambda x, d: F.relu(x),
    "relu2": lambda x, d: F.relu(x).square(),
    "exp": lambda x, d: torch.exp(x / d),
}
FEATURE_MAP_NAMES = (*FEATURE_MAPS, "rff")


def build_feature_map(name: str, head_dim: int, layer_idx: int = 0):
    """φ in fp32: the random-features module (its projection is saved with the weights), or an
    elementwise map whose feature dimension equals head_dim."""
    if name == "rff":
        return RandomFeatures(head_dim, seed=layer_idx)
    fn = FEATURE_MAPS[name]
    return lambda x: fn(x.float(), head_dim)


def linear_attention(fq, fk, v, eps: float = EPS) -> torch.Tensor:
    """Bidirectional: every query sees every key through the two global sums."""
    s_v = fk.transpose(-2, -1) @ v.float()  # [.., F, D]
    s_k = fk.sum(-2)  # [.., F]
    return (fq @ s_v) / ((fq * s_k[..., None, :]).sum(-1, keepdim=True) + eps)


def causal_linear_attention(fq, fk, v, state=None, chunk: int = 64, eps: float = EPS):
    """Causal form with running prefix sums. fq/fk [B,H,T,F], v [B,H,T,D].

    state: (S [B,H,F,D], z [B,H,F]) from earlier tokens, or None. Returns (out [B,H,T,D] fp32,
    new state)."""
    b, h, t, f = fq.shape
    v = v.float()
    if state is None:
        s = fq.new_zeros(b, h, f, v.shape[-1])
        z = fq.new_zeros(b, h, f)
    else:
        s, z = state
    outs = []
    for i in range(0, t, chunk):
        q_c, k_c, v_c = fq[:, :, i : i + chunk], fk[:, :, i : i + chunk], v[:, :, i : i + chunk]
        a = (q_c @ k_c.transpose(-2, -1)).tril()  # within-chunk causal part
        num = a @ v_c + q_c @ s
        den = a.sum(-1) + (q_c * z[:, :, None]).sum(-1)
        outs.append(num / (den[..., None] + eps))
        s = s + k_c.transpose(-2, -1) @ v_c
        z = z + k_c.sum(2)
    return torch.cat(outs, dim=2), (s, z)


class LinearAttention(CausalSelfAttention):
    """Drop-in for CausalSelfAttention (config attention="linear"): the same projections and
    RoPE (`project`), causal linear attention instead of softmax. Masks other than key padding
    do not apply."""

    supports_masks = False

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.q_norm = self.k_norm = None  # qk_norm is a softmax-attention option
        self.feature_map = build_feature_map(config.linear_feature_map, self.head_dim, layer_idx)

    def forward(self, x, rope=None, rope_tables=None, mask=None, is_causal=True, cache=None):
        b, t, _ = x.shape
        q, k, v = self.project(x, rope, rope_tables)
        groups = self.n_head // self.n_kv_head
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        fq, fk = self.feature_map(q), self.feature_map(k)
        if mask is not None and mask.dim() == 4:
            # Padding: the model's [B,1,t,s] mask; its last row is the key mask (left padding),
            # and a padding key must not enter the sums.
            fk = fk * mask[:, :, -1, -t:, None].to(fk.dtype)
        state = cache.state(self.layer_idx) if cache is not None else None
        y, state = causal_linear_attention(fq, fk, v, state)
        if cache is not None:
            cache.write(self.layer_idx, state)
        y = y.to(x.dtype).transpose(1, 2).reshape(b, t, -1)
        return self.resid_dropout(self.o_proj(y))
