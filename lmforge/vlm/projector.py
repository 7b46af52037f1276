"""Projectors: vision features v_j (d_v) -> language-model embeddings h_j (d_model).

LLaVA (Liu et al. 2023): h_j = W_proj v_j + b_proj (LLaVA 1.0). LLaVA 1.5 found a 2-layer MLP
(Linear -> GELU -> Linear) works better; both are picked by name from PROJECTORS.
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.errors import require_choice


class LinearProjector(nn.Module):
    """h = W_proj v + b_proj."""

    def __init__(self, d_vision: int, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_vision, d_model)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)


class MLPProjector(nn.Module):
    """h = W_2 GELU(W_1 v + b_1) + b_2 (LLaVA 1.5's mlp2x_gelu)."""

    def __init__(self, d_vision: int, d_model: int):
        super().__init__()
        self.fc1 = nn.Linear(d_vision, d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_model, d_model)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(features)))


PROJECTORS: dict[str, type[nn.Module]] = {"linear": LinearProjector, "mlp2": MLPProjector}


def build_projector(kind: str, d_vision: int, d_model: int) -> nn.Module:
    require_choice("projector", kind, PROJECTORS)
    return PROJECTORS[kind](d_vision, d_model)
