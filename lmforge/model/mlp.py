"""Feed-forward blocks: the classic two-layer MLP and the gated (GLU) family."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.balanced_moe import BalancedMoE

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    """W2 act(W1 x + b1) + b2 (GPT-2 style with GELU)."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, dropout: float):
        super().__init__()
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(self.act(self.up_proj(x))))


class GatedMLP(nn.Module):
    """GLU family: down(act(gate(x)) * up(x)). SwiGLU uses SiLU (Llama), GEGLU uses GELU."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, dropout: float):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)))


# config.mlp -> (class, activation)
MLP_KINDS: dict[str, tuple[type[nn.Module], str]] = {
    "gelu": (MLP, "gelu"),
    "gelu_tanh": (MLP, "gelu_tanh"),
    "relu": (MLP, "relu"),
    "silu": (MLP, "silu"),
    "swiglu": (GatedMLP, "silu"),
    "geglu": (GatedMLP, "gelu"),  # exact GELU (erf)
    "geglu_tanh": (GatedMLP, "gelu_tanh"),  # tanh-approximated GELU (GPT-2, Gemma)
    "moe": (BalancedMoE, "silu"),  # Mixtral: SwiGLU experts (+ capacity, aux loss, shared)
}


def build_mlp(
    kind: str, d_model: int, d_ff: int, bias: bool, dropout: float, **options
) -> nn.Module:
    """The feed-forward block named by `kind`; `options` go to kinds that take more (MoE)."""
    cls, activation = MLP_KINDS[kind]
    return cls(d_model, d_ff, activation, bias, dropout, **options)
