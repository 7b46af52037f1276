"""A lean inference forward for the common pre-norm transformer (Llama, Mistral, Qwen, GPT-2).

`Transformer.forward` is written to teach and to train: each block goes through norm modules,
residual wiring, dropout and reshapes, about 50 small ops per layer. Decoding one token on a CPU
spends much of its time outside the matmuls in those ops, so the engine runs this instead: the
same modules (so the same weights, quantised or not: quantized_linear.py) and the same formulas,
with about half the ops. Activations stay 2-D [B*T, d] and Q and K are rotated in one pass. (Fusing
the MLP's gate and up projections into one matmul measured no faster, so it is not done.)
Configs it does not cover (post-norm, parallel blocks, MoE, non-softmax attention) fall back to
the model's own forward: see `FastDecoder.unsupported`.

The output equals `Transformer.forward(input_ids, positions=..., cache=..., last_only=...)` up to
float rounding (tests/infer/test_decoder.py compares them on several configs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.infer.cpu_gemv import gemv_kernel
from lmforge.infer.quantize import to_inference_precision
from lmforge.infer.quantized_linear import QuantizedLinear
from lmforge.model.attention import CausalSelfAttention
from lmforge.model.cache import full_attention
from lmforge.model.mlp import MLP, GatedMLP
from lmforge.model.norms import LayerNorm, RMSNorm
from lmforge.model.positions import rope_scaling_type
from lmforge.model.transformer import Transformer


def plain_linear(m: nn.Module):
    """x [N, in] -> [N, out] for a Linear or a QuantizedLinear, without nn.Module call overhead.
    bf16 / fp16 weights on a CPU go through lmforge's GEMV for few rows (cpu_gemv_half.c: torch's
    bf16 matmul with one row read the weights at a third of the bandwidth on a Zen 4 core)."""
    if isinstance(m, QuantizedLinear):
        return m.matmul
    if type(m) is nn.Linear:
        weight, bias = m.weight, m.bias  # Parameters: later in-place updates are seen
        kernel = half_weights_kernel(weight)
        if kernel is not None:
            half_linear = kernel.ops.half_linear
            if bias is None:
                return lambda x: half_linear(x, weight)
            return lambda x: half_linear(x, weight) + bias
        return lambda x: F.linear(x, weight, bias)
    return m


def half_weights_kernel(weight: torch.Tensor):
    """The native kernels (cpu_gemv) for a CPU layer with bf16 or fp16 weights, else None."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    return gemv_kernel() if weight.is_contiguous() else None


def plain_norm(m: nn.Module):
    """The model's norm as one fused op; same formula (fp32 inside, cast back)."""
    if type(m) not in (RMSNorm, LayerNorm):
        return m
    w, shape, eps = m.weight.float(), m.weight.shape, m.eps
    if type(m) is RMSNorm:
        return lambda x: F.rms_norm(x.float(), shape, w, eps).to(x.dtype)
    b = None if m.bias is None else m.bias.float()
    return lambda x: F.layer_norm(x.float(), shape, w, b, eps).to(x.dtype)


NATIVE_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def native_attention(q: torch.Tensor, k: torch.Tensor):
    """The native kernels (cpu_gemv) when their decode attention covers these inputs, else None."""
    if q.device.type != "cpu" or k.dtype not in NATIVE_KV_DTYPES or k.stride(-1) != 1:
        return None
    if torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        return None  # torch.compile (compiled_step.py) specialised on every cache width with it
    return gemv_kernel()


def decode_attention(q, k, v, mask=None, kernel=None) -> torch.Tensor:
    """One query per row over the cache. q [B, H, 1, D], k/v [B, KV, L, D], mask None or bool
    [B, 1, 1, L] -> [B, H, 1, D].

    On a CPU with the native kernels, cpu_attention.c: the cache is read once for the query
    heads that share it and converted in registers (2.3x inductor's loop below at 16 rows x 256
    keys, 3x at one row, Zen 4). Otherwise broadcast products and sums: eagerly they would
    materialise [B, heads, L, D] products, but under torch.compile (the only place this runs
    without the kernels) inductor turns them into one fused loop over the keys, where SDPA is an
    external kernel whose fixed cost (~15-30 us a call on a CPU) dominates a short decode step.
    fp32 arithmetic either way. `kernel`: native_attention's answer when the caller has it."""
    kernel = kernel or native_attention(q, k)
    if kernel is not None and (mask is None or mask.dtype == torch.bool):
        return kernel.decode_attention(q.float(), k, v, mask).to(q.dtype)
    b, h, _, d = q.shape
    kv, dtype = k.shape[1], q.dtype
    q = q.view(b, kv, h // kv, 1, d).float()
    scores = (q * k[:, :, None].float()).sum(-1) * d**-0.5  # [B, KV, G, L]
    if mask is not None:
        scores = scores.masked_fill(~mask.view(b, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    y = (probs[..., None] * v[:, :, None].float()).sum(-2)  # [B, KV, G, D]
    return y.to(dtype).view(b, h, 1, d)


class _Layer:
    """One block's parts as plain functions (module dispatch and attribute lookups cost
    microseconds each, at every token, in every layer)."""

    def __init__(self, block: nn.Module):
        attn, mlp = block.attn, block.mlp
        self.attn_norm, self.mlp_norm = plain_norm(block.attn_norm), plain_norm(block.mlp_norm)
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.qkv, self.o = plain_linear(attn.qkv_proj), plain_linear(attn.o_proj)
        self.act = mlp.act
        self.down, self.up = plain_linear(mlp.down_proj), plain_linear(mlp.up_proj)
        self.gate = plain_linear(mlp.gate_proj) if isinstance(mlp, GatedMLP) else None

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.down(self.act(self.gate(h)) * self.up(h))
        return self.down(self.act(self.up(h)))


class FastDecoder:
    """Callable like `Transformer.forward` for inference (ids, positions, cache, last_only)."""

    def __init__(self, model: Transformer):
        reason = self.unsupported(model)
        if reason:
            raise ValueError(f"FastDecoder does not cover this model: {reason}")
        self.model, self.config = model, model.config
        self.layers = [_Layer(b) for b in model.blocks]
        self.lm_head, self.norm = plain_linear(model.lm_head), plain_norm(model.norm)
        attn = model.blocks[0].attn
        self.n_head, self.n_kv_head, self.head_dim = attn.n_head, attn.n_kv_head, attn.head_dim
        self.gqa = self.n_head != self.n_kv_head
        self.lm_head_out = model.lm_head.out_features

    @staticmethod
    def unsupported(model) -> str | None:
        """Why this model needs its own forward (None: FastDecoder runs it)."""
        if not isinstance(model, Transformer):
            return f"{type(model).__name__} is not a Transformer"
        if not full_attention(model.config):
            return "attention other than full softmax"
        for block in model.blocks:
            if block.wiring != "pre":
                return "post-norm or parallel residual wiring"
            if type(block.attn) is not CausalSelfAttention:
                return f"attention module {type(block.attn).__name__}"
            if type(block.mlp) not in (MLP, GatedMLP):
                return f"MLP module {type(block.mlp).__name__}"
        return None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache=None,
        last_only: bool = False,
    ) -> torch.Tensor:
        model = self.model
        b, t = input_ids.shape
        start = cache.length if cache is not None else 0
        key_mask = cache.key_mask if cache is not None else None
        if positions is None:
            positions = model._positions(start, start + t, key_mask, input_ids.device)
        if t == 1 and key_mask is not None:  # decode: a query sees exactly the real keys
            mask, is_causal = key_mask[:, None, None, : start + 1], False
        else:
            mask, is_causal = model._mask(t, start + t, key_mask, input_ids.device)
        x = model.embed(input_ids)
        if model.abs_pos is not None:
            x = x + model.abs_pos(positions)
        x = x.view(b * t, -1)
        cos = sin = None
        if model.rope is not None:
            cos, sin = model.rope.tables(positions, x.dtype)
            # [T, D] or [B, 1, T, D] -> [B*T, 1, D], to broadcast over heads in [B*T, heads, D]
            cos, sin = (c.expand(b, 1, t, c.shape[-1]).reshape(b * t, 1, -1) for c in (cos, sin))
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, layer.attn_norm(x), b, t, cos, sin, cache, mask,
                                    is_causal)  # fmt: skip
            x = x + layer.mlp(layer.mlp_norm(x))
        if cache is not None:
            cache.advance(t)
        x = x.view(b, t, -1)
        if last_only:
            x = x[:, -1:]
        x = self.norm(x.reshape(-1, x.shape[-1]))
        if model.output_scale != 1.0:
            x = x * model.output_scale
        return self.lm_head(x).view(b, -1, self.lm_head_out)

    def _attention(self, i, layer, h, b, t, cos, sin, cache, mask, is_causal) -> torch.Tensor:
        """Self-attention of layer i on normed activations h [B*T, d] -> [B*T, d]."""
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        qkv = layer.qkv(h)
        qk = qkv[:, : (nh + nkv) * hd].view(b * t, nh + nkv, hd)
        if layer.q_norm is not None:
            qk = torch.cat([layer.q_norm(qk[:, :nh]), layer.k_norm(qk[:, nh:])], dim=1)
        if cos is not None:
            qk = self.model.rope.rotate(qk, cos, sin)  # queries and keys in one pass
        q = qk[:, :nh].view(b, t, nh, hd).transpose(1, 2)
        k = qk[:, nh:].view(b, t, nkv, hd).transpose(1, 2)
        v = qkv[:, (nh + nkv) * hd :].view(b, t, nkv, hd).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(i, k, v)
        kernel = native_attention(q, k) if t == 1 else None  # once per layer: a hot path
        if t == 1 and (kernel is not None or torch.compiler.is_compiling()):
            y = decode_attention(q, k, v, mask, kernel)
            return layer.o(y.reshape(b, nh * hd))
        if t == 1 and q.device.type == "cpu" and torch.float32 not in (q.dtype, k.dtype):
            # torch's CPU flash attention runs one bf16 query 3-4x slower than the same in fp32
            # (165 vs 57 us a layer at 256 keys, Zen 4): upcasting the cache rows costs less
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                               enable_gqa=self.gqa).to(q.dtype)  # fmt: skip
        else:
            if k.dtype != q.dtype:  # an fp16 cache under fp32 activations (engine.py)
                k, v = k.to(q.dtype), v.to(q.dtype)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                               enable_gqa=self.gqa)  # fmt: skip
        return layer.o(y.transpose(1, 2).reshape(b * t, nh * hd))


def inference_forward(model, dtype, quantize):
    """(model, forward): the model in the asked precision (a converted copy when that differs
    from the caller's) and the function that runs it (decoder.FastDecoder when it covers the
    model, else the model's own forward)."""
    model = to_inference_precision(model, dtype, quantize)
    return model, fast_forward(model)


def fast_forward(model):
    """FastDecoder (same outputs, about half the ops per token) where it covers the model,
    else the model itself."""
    return model if FastDecoder.unsupported(model) else FastDecoder(model)


def fixed_step_unsupported(forward) -> str | None:
    """Why a decode step compiled into fixed code (a CUDA graph, an ahead-of-time export) cannot
    run this forward; None when it can."""
    if not isinstance(forward, FastDecoder):
        return "the fast decoder does not cover this model"
    if rope_scaling_type(getattr(forward.config, "rope_scaling", None)) == "dynamic":
        return "dynamic RoPE scaling reads the positions on the host every step"
    return None
