"""The feed-forward block a config names (config.mlp): a dense MLP (mlp.py) or a mixture of
experts (moe.py). This registry is the one list of valid `mlp` values; ModelConfig validates
against it."""

from __future__ import annotations

from torch import nn

from lmforge.model.mlp import MLP, GatedMLP
from lmforge.model.moe import MoE

# config.mlp -> (class, activation)
MLP_KINDS: dict[str, tuple[type[nn.Module], str]] = {
    "gelu": (MLP, "gelu"),
    "gelu_tanh": (MLP, "gelu_tanh"),
    "relu": (MLP, "relu"),
    "relu2": (MLP, "relu2"),
    "silu": (MLP, "silu"),
    "swiglu": (GatedMLP, "silu"),
    "geglu": (GatedMLP, "gelu"),  # exact GELU (erf)
    "geglu_tanh": (GatedMLP, "gelu_tanh"),  # tanh-approximated GELU (GPT-2, Gemma)
    "moe": (MoE, "silu"),  # Mixtral: SwiGLU experts (+ capacity, aux loss, shared)
}


def build_mlp(
    kind: str, d_model: int, d_ff: int, bias: bool, dropout: float, **options
) -> nn.Module:
    """The feed-forward block named by `kind`; `options` go to kinds that take more (MoE)."""
    cls, activation = MLP_KINDS[kind]
    return cls(d_model, d_ff, activation, bias, dropout, **options)
