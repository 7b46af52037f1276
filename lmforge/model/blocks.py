"""How a block wires its attention and MLP into the residual stream, and which attention it uses.

`Block` (transformer.py) owns the parts: attn_norm, attn, mlp_norm, mlp. A *residual* module from
this file decides the wiring, chosen by the config:

    pre       h = h + Attn(N1(h));      h = h + FFN(N2(h))          (GPT-2, Llama; default)
    post      h = N1(h + Attn(h));      h = N2(h + FFN(h))          (original Transformer, BERT)
    parallel  h = h + a·Attn(N(h)) + m·FFN(N(h)), one shared norm   (GPT-J, PaLM)

with a, m = 1, 1/√2 or learnable scalars, and DropPath (stochastic depth) on every branch.
The attention kind (softmax, linear, mla) is a registry too, as is the cache each kind needs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmforge.model.attention import CausalSelfAttention
from lmforge.model.cache import KVCache, RollingKVCache
from lmforge.model.linear_attention import LinearAttention, LinearStateCache
from lmforge.model.masks import pattern_for
from lmforge.model.mla import LatentKVCache, MultiHeadLatentAttention

ATTENTION_CLASSES: dict[str, type[nn.Module]] = {
    "softmax": CausalSelfAttention,
    "linear": LinearAttention,
    "mla": MultiHeadLatentAttention,
}


class DropPath(nn.Module):
    """Stochastic depth: in training, drop a sample's whole branch with probability p and scale
    the survivors by 1/(1-p) (inverted, like dropout); identity at eval."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(1.0 - self.p)
        return x * keep / (1.0 - self.p)


class PreNormResidual(nn.Module):
    """h = h + Attn(N1(h)); h = h + FFN(N2(h))."""

    shared_norm = False  # True: the block needs only attn_norm

    def __init__(self, config):
        super().__init__()
        self.drop_attn = DropPath(config.drop_path)
        self.drop_mlp = DropPath(config.drop_path)

    def forward(self, block: nn.Module, h: torch.Tensor, attn) -> torch.Tensor:
        h = h + self.drop_attn(attn(block.attn_norm(h)))
        return h + self.drop_mlp(block.mlp(block.mlp_norm(h)))


class PostNormResidual(PreNormResidual):
    """h = N1(h + Attn(h)); h = N2(h + FFN(h))."""

    def forward(self, block: nn.Module, h: torch.Tensor, attn) -> torch.Tensor:
        h = block.attn_norm(h + self.drop_attn(attn(h)))
        return block.mlp_norm(h + self.drop_mlp(block.mlp(h)))


class ParallelResidual(PreNormResidual):
    """h + a·Attn(N(h)) + m·FFN(N(h)): both branches read one shared norm, so the two matmul
    groups can run together. `parallel_scale`: "none" (a = m = 1), "inv_sqrt2" (the sum of two
    unit-variance branches keeps unit variance), "learnable" (a, m trained, start at 1)."""

    shared_norm = True

    def __init__(self, config):
        super().__init__(config)
        kind = config.parallel_scale
        init = torch.full((2,), 1 / math.sqrt(2) if kind == "inv_sqrt2" else 1.0)
        if kind == "learnable":
            self.branch_scales = nn.Parameter(init)
        else:
            self.register_buffer("branch_scales", init, persistent=False)

    def init_weights(self) -> None:
        """Called by Transformer.reset_parameters: learnable scales start at 1."""
        if isinstance(self.branch_scales, nn.Parameter):
            nn.init.ones_(self.branch_scales)

    def forward(self, block: nn.Module, h: torch.Tensor, attn) -> torch.Tensor:
        x = block.attn_norm(h)
        a, m = self.branch_scales.to(h.dtype)
        return h + a * self.drop_attn(attn(x)) + m * self.drop_mlp(block.mlp(x))


RESIDUALS: dict[str, type[nn.Module]] = {
    "pre": PreNormResidual,
    "post": PostNormResidual,
    "parallel": ParallelResidual,
}


def build_residual(config) -> nn.Module:
    kind = "parallel" if getattr(config, "parallel_block", False) else config.norm_position
    return RESIDUALS[kind](config)


def softmax_cache(config, batch_size, max_len, dtype=torch.float32, device="cpu") -> KVCache:
    """A rolling buffer when the mask pattern bounds how far back a query looks, else full."""
    pattern = pattern_for(config)
    if pattern is not None and pattern.keep is not None:
        return RollingKVCache.for_model(config, batch_size, max_len, dtype, device, pattern.keep)
    return KVCache(
        config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim, dtype, device
    )


CACHES = {
    "softmax": softmax_cache,
    "linear": LinearStateCache.for_model,
    "mla": LatentKVCache.for_model,
}


def new_cache(config, batch_size: int, max_len: int, dtype=torch.float32, device="cpu"):
    """The decoding cache `config`'s attention kind needs (KVCache.for_model calls this)."""
    return CACHES[getattr(config, "attention", "softmax")](
        config, batch_size, max_len, dtype, device
    )
