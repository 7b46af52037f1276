"""Dense feed-forward blocks: the classic two-layer MLP and the gated (GLU) family.

config.mlp picks one of these, or the mixture of experts (moe.py), through feedforward.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.linear import Linear

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),  # ReLU^2 (So et al. 2021, "Primer"; modded-nanogpt)
    "silu": F.silu,
}


class MLP(nn.Module):
    """W2 act(W1 x + b1) + b2 (GPT-2 style with GELU); `GatedMLP` is its GLU form."""

    gated = False

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, dropout: float):
        super().__init__()
        if self.gated:
            self.gate_proj = Linear(d_model, d_ff, bias=bias)
        self.up_proj = Linear(d_model, d_ff, bias=bias)
        self.down_proj = Linear(d_ff, d_model, bias=bias)
        self.act = ACTIVATIONS[activation]
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])  # [B*T, d]: 2-D for the matmul kernels
        up = self.up_proj(h)
        y = self.down_proj(self.act(self.gate_proj(h)) * up if self.gated else self.act(up))
        y = y.view(x.shape)
        return self.dropout(y) if self.training else y  # a call costs microseconds per token


class GatedMLP(MLP):
    """GLU family: down(act(gate(x)) * up(x)). SwiGLU uses SiLU (Llama), GEGLU uses GELU."""

    gated = True
