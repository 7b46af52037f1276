"""Projectors: vision features v_j (d_v) -> language-model embeddings h_j (d_model).

LLaVA (Liu et al. 2023): h_j = W_proj v_j + b_proj (LLaVA 1.0). LLaVA 1.5 found a 2-layer MLP
(Linear -> GELU -> Linear) works better; both are picked by name from PROJECTORS.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from lmforge.errors import require_choice

# name -> the named layers, applied in order (the names are the checkpoints' tensor names)
PROJECTORS = {
    "linear": lambda d_vision, d_model: {"proj": nn.Linear(d_vision, d_model)},
    "mlp2": lambda d_vision, d_model: {  # LLaVA 1.5's mlp2x_gelu
        "fc1": nn.Linear(d_vision, d_model),
        "act": nn.GELU(),
        "fc2": nn.Linear(d_model, d_model),
    },
}


def build_projector(kind: str, d_vision: int, d_model: int) -> nn.Sequential:
    require_choice("projector", kind, PROJECTORS)
    return nn.Sequential(OrderedDict(PROJECTORS[kind](d_vision, d_model)))
