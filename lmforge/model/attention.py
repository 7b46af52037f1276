"""Causal self-attention with multi-head, grouped-query and multi-query key/value heads.

softmax(Q K^T / sqrt(d_head) + M) V, with two interchangeable kernels: an explicit one that
spells the formula out (for teaching and for tests) and PyTorch's fused
`scaled_dot_product_attention`. n_kv_head = n_head is MHA, 1 is MQA, anything dividing n_head
is GQA: query head h reads key/value group h // (n_head / n_kv_head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.cache import KVCache
from lmforge.model.linear import Linear
from lmforge.model.masks import Window, build_mask
from lmforge.model.norms import RMSNorm


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    dropout: float = 0.0,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The textbook formula. q [B,H,T,D], k/v [B,G,S,D] with G dividing H; mask True = attend.
    `scale` replaces 1/sqrt(D); `softcap` c bounds the scores to (-c, c) as c * tanh(s / c)
    before masking (Gemma 2), which no fused kernel does."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)).float() * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        mask = causal_mask(*scores.shape[-2:], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)  # stable: softmax subtracts the row max
    if dropout > 0:
        probs = F.dropout(probs, dropout)
    return probs @ v


def sdpa_attention(
    q, k, v, mask=None, is_causal=False, dropout=0.0, scale=None, softcap=None
) -> torch.Tensor:
    """The same computation through PyTorch's fused kernel (flash/memory-efficient/math); a
    soft-capped model goes the explicit way (the fused kernels have no cap)."""
    if softcap is not None:
        return explicit_attention(q, k, v, mask, is_causal, dropout, scale, softcap)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout,
        enable_gqa=k.shape[1] != q.shape[1], scale=scale,
    )  # fmt: skip


ATTENTION_KERNELS = {"explicit": explicit_attention, "sdpa": sdpa_attention}


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
    scale: float | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """One query per row over its keys as broadcast products and sums, in fp32: q [B, H, 1, D],
    k / v [B, G, L, D], mask None or bool [B, 1, 1, L] -> [B, H, 1, D]. Eagerly this would
    materialise [B, H, L, D] products; it is what a compiled decode step runs, where inductor
    turns it into one fused loop over the keys (SDPA there is an external kernel whose fixed cost
    per call outweighs a short step's attention)."""
    b, h, _, d = q.shape
    g, dtype = k.shape[1], q.dtype
    q = q.view(b, g, h // g, 1, d).float()
    scores = (q * k[:, :, None].float()).sum(-1) * (scale or d**-0.5)  # [B, G, H/G, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    y = (probs[..., None] * v[:, :, None].float()).sum(-2)  # [B, G, H/G, D]
    return y.to(dtype).view(b, h, 1, d)


class CausalSelfAttention(nn.Module):
    """Projects to Q/K/V (one fused matmul), rotates Q/K if RoPE, attends, projects back."""

    # A fused kernel for one query per row over a cache (decoding), with the signature of
    # `decode_attention`, or None. Inference sets it (lmforge.infer.quantize.inference_model:
    # the CPU's native kernel, which reads each cached key once for all the heads sharing it).
    decode_kernel = None
    # The same for a causal prefill with no cache before it (q, k, v [B, *, T, D] -> [B, H, T,
    # D]), or None: inference sets the CPU's native kernel (about 3x torch's SDPA at 128 tokens).
    prefill_kernel = None

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.head_dim
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.qkv_proj = Linear(config.d_model, q_dim + 2 * kv_dim, bias=config.attention_bias)
        self.o_proj = Linear(q_dim, config.d_model, bias=config.attention_out_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # per-head RMSNorm keeps attention logits bounded (Qwen3)
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        self.kernel = ATTENTION_KERNELS[config.attn_impl]
        self.cap = (config.attn_scale, config.attn_logit_softcap)  # Gemma: (scale, softcap)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope=None,
        rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None,
        mask: torch.Tensor | None = None,
        is_causal: bool = True,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]. `mask`/`is_causal` come from the model, which
        knows about padding and how many positions the cache already holds."""
        b, t, _ = x.shape
        q, k, v = self.project(x, rope, rope_tables)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            # Under CPU autocast, matmuls gain from bf16 (AMX), but the CPU flash-attention
            # backward is several times slower in bf16 than in fp32: attend in fp32.
            with torch.autocast("cpu", enabled=False):
                y = self.kernel(
                    q.float(), k.float(), v.float(), mask, is_causal, self.p_drop, *self.cap
                )
        elif t == 1 and not self.training and self.kernel is sdpa_attention:
            y = self.decode(q, k, v, mask)
        elif self.prefill_kernel is not None and self.fused_prefill(q, k, mask, is_causal):
            y = self.prefill_kernel(q.float(), k.float(), v.float()).to(q.dtype)
        else:
            y = self.kernel(q, k, v, mask, is_causal, self.p_drop, *self.cap)
        y = self.o_proj(y.transpose(1, 2).reshape(b * t, -1)).view(b, t, -1)
        return self.resid_dropout(y) if self.training else y

    @property
    def p_drop(self) -> float:
        """Attention dropout: only while training."""
        return self.dropout if self.training else 0.0

    def project(self, x: torch.Tensor, rope=None, rope_tables=None) -> tuple[torch.Tensor, ...]:
        """x [B, T, d_model] -> q [B, n_head, T, D], k and v [B, n_kv_head, T, D] (q and k
        normed and rotated where the config asks): one view of the fused projection's output as
        heads, queries and keys rotated in one pass."""
        b, t, _ = x.shape
        nh = self.n_head
        qkv = self.qkv_proj(x.reshape(b * t, -1))  # 2-D for the matmul kernels
        heads = qkv.view(b, t, -1, self.head_dim).transpose(1, 2)  # the q, k and v heads
        qk, v = heads[:, : nh + self.n_kv_head], heads[:, nh + self.n_kv_head :]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        if rope is not None:
            qk = rope.rotate(qk, *rope_tables)
        return qk[:, :nh], qk[:, nh:], v

    def fused_prefill(self, q, k, mask, is_causal) -> bool:
        """Whether `prefill_kernel` takes this forward: causal over exactly the new keys, no
        mask, cap or gradient, eager on a CPU (torch.compile keeps SDPA)."""
        return (
            is_causal
            and mask is None
            and not self.training
            and self.kernel is sdpa_attention
            and self.cap == (None, None)
            and q.device.type == "cpu"
            and k.shape[2] == q.shape[2]
            and not q.requires_grad
            and not torch.compiler.is_compiling()
        )

    def decode(self, q, k, v, mask) -> torch.Tensor:
        """One new query per row over the cache (no dropout, no causal part: the mask says which
        keys are real). The fused `decode_kernel` where it takes these inputs; inside a compiled
        step `decode_attention` (inductor fuses it); else SDPA."""
        kernel = self.decode_kernel
        if (
            kernel is not None
            and self.cap == (None, None)
            and q.device.type == "cpu"
            and k.stride(-1) == 1
            and (mask is None or mask.dtype == torch.bool)
            and not q.requires_grad
            and not (torch.compiler.is_compiling() and not torch.compiler.is_exporting())
        ):
            # (torch.compile specialises on every cache width with an external op: not there)
            return kernel(q.float(), k, v, mask).to(q.dtype)  # fmt: skip
        if torch.compiler.is_compiling():
            return decode_attention(q, k, v, mask, *self.cap)
        if q.device.type == "cpu" and torch.float32 not in (q.dtype, k.dtype):
            # torch's CPU flash attention runs one bf16 query several times slower than the
            # same in fp32: upcasting the cache rows costs less
            y = sdpa_attention(q.float(), k.float(), v.float(), mask, False, 0.0, *self.cap)
            return y.to(q.dtype)
        if k.dtype != q.dtype:  # e.g. an fp16 cache under fp32 activations
            k, v = k.to(q.dtype), v.to(q.dtype)
        return sdpa_attention(q, k, v, mask, False, 0.0, *self.cap)


def causal_mask(
    t: int, s: int, device=None, window: int | None = None, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """[t, s] bool: the t newest queries (ending at key s-1) see keys j <= their own position
    (and, with a sliding `window` W, only the W newest of those: i - W < j, as Mistral does).
    With `key_mask` ([B, >=s] bool, True = real) padding keys are hidden too, giving [B, 1, t, s];
    each query may always see itself, so rows that are entirely padding stay finite (their
    outputs are never used)."""
    if key_mask is not None:
        device, key_mask = key_mask.device, key_mask[:, :s]
    keys = torch.arange(s, device=device)
    pattern = Window(window) if window is not None else None
    return build_mask(keys[s - t :], keys, pattern, key_mask=key_mask)
