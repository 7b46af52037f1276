"""The transformer block: attention and a feed-forward block on the residual stream.

`Block.forward` spells out the three wirings; the config picks one:

    pre       x = x + Attn(N1(x));      x = x + FFN(N2(x))          (GPT-2, Llama; default)
    post      x = N1(x + Attn(x));      x = N2(x + FFN(x))          (original Transformer, BERT)
    sandwich  x = x + P1(Attn(N1(x)));  x = x + P2(FFN(N2(x)))      (Gemma 2/3: a norm after too)
    parallel  x = x + a·Attn(N(x)) + m·FFN(N(x)), one shared norm   (GPT-J, PaLM)

with a, m = 1, 1/√2 or learnable scalars (BRANCH_SCALES), and DropPath (stochastic depth) on
every branch. The attention kind (softmax, linear, mla) is chosen from ATTENTION_CLASSES, the
feed-forward block from feedforward.MLP_KINDS. These tables are the lists of valid config values:
ModelConfig validates against them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lmforge.model.attention import CausalSelfAttention
from lmforge.model.feedforward import build_mlp
from lmforge.model.linear_attention import LinearAttention
from lmforge.model.mla import MultiHeadLatentAttention
from lmforge.model.norms import build_norm

# config.attention -> the attention module (each takes (config, layer_idx) and is called with
# (x, rope, rope_tables, mask, is_causal, cache)); cache.CACHES has the cache each one needs.
ATTENTION_CLASSES: dict[str, type[nn.Module]] = {
    "softmax": CausalSelfAttention,
    "linear": LinearAttention,
    "mla": MultiHeadLatentAttention,
}

# config.norm_position: where the norms sit in Block.forward (config.parallel_block=True makes
# the "pre" block parallel)
NORM_POSITIONS = ("pre", "post", "sandwich")

# config.parallel_scale -> the initial branch scales a, m of a parallel block; "learnable"
# trains them from 1 (the sum of two unit-variance branches has variance 2; 1/√2 undoes it)
BRANCH_SCALES: dict[str, float] = {"none": 1.0, "inv_sqrt2": 1 / math.sqrt(2), "learnable": 1.0}


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


class Block(nn.Module):
    """One layer: attn_norm, attn, mlp_norm, mlp, wired as `wiring` says ("pre", "post" or
    "parallel"; see the module docstring). `config` is a ModelConfig."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.wiring = "parallel" if config.parallel_block else config.norm_position
        self.attn_norm = build_norm(config)
        self.attn = ATTENTION_CLASSES[config.attention](config, layer_idx)
        self.drop_attn = DropPath(config.drop_path)
        self.drop_mlp = DropPath(config.drop_path)
        if self.wiring == "parallel":
            scale = BRANCH_SCALES[config.parallel_scale]
            if config.parallel_scale == "learnable":  # starts at 1 (Transformer.reset_parameters)
                self.branch_scales = nn.Parameter(torch.full((2,), scale))
            else:  # fixed numbers: no state in checkpoints
                self.branch_scales = (scale, scale)
            self.mlp_norm = nn.Identity()  # both branches read attn_norm's output
        else:
            self.mlp_norm = build_norm(config)
        if self.wiring == "sandwich":  # a second norm on each branch's output
            self.attn_post_norm, self.mlp_post_norm = build_norm(config), build_norm(config)
        moe = dict(n_experts=config.n_experts, top_k=config.experts_top_k,
                   capacity_factor=config.capacity_factor, aux_loss_weight=config.aux_loss_weight,
                   n_shared_experts=config.n_shared_experts)  # fmt: skip
        self.mlp = build_mlp(
            config.mlp, config.d_model, config.d_ff, config.mlp_bias, config.dropout,
            **(moe if config.mlp == "moe" else {}),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, *attn_args: Any, **attn_kwargs: Any) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]; the other arguments (rope, rope_tables, mask,
        is_causal, cache) go to the attention as they are."""

        if self.wiring == "pre" and not self.training:  # inference: no DropPath to apply
            x = x + self.attn(self.attn_norm(x), *attn_args, **attn_kwargs)
            return x + self.mlp(self.mlp_norm(x))

        def attn(h: torch.Tensor) -> torch.Tensor:
            return self.drop_attn(self.attn(h, *attn_args, **attn_kwargs))

        def mlp(h: torch.Tensor) -> torch.Tensor:
            return self.drop_mlp(self.mlp(h))

        if self.wiring == "pre":
            x = x + attn(self.attn_norm(x))
            x = x + mlp(self.mlp_norm(x))
        elif self.wiring == "sandwich":
            x = x + self.attn_post_norm(attn(self.attn_norm(x)))
            x = x + self.mlp_post_norm(mlp(self.mlp_norm(x)))
        elif self.wiring == "post":
            x = self.attn_norm(x + attn(x))
            x = self.mlp_norm(x + mlp(x))
        else:  # parallel
            h = self.attn_norm(x)
            a, m = self.branch_scales
            x = x + a * attn(h) + m * mlp(h)
        return x
