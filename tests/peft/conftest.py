"""A toy transformer-shaped module (q/k/v/o projections and an MLP in a ModuleList of blocks)
for the PEFT tests: it has the layer names real models have, without lmforge.model."""

import pytest
import torch
from torch import nn


class ToyAttention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h):
        att = torch.softmax(self.q_proj(h) @ self.k_proj(h).transpose(-1, -2), dim=-1)
        return self.o_proj(att @ self.v_proj(h))


class ToyMLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h):
        return self.proj(torch.relu(self.fc(h)))


class ToyBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn, self.mlp = ToyAttention(d), ToyMLP(d)

    def forward(self, h):
        h = h + self.attn(self.ln(h))
        return h + self.mlp(h)


class ToyLM(nn.Module):
    def __init__(self, vocab: int = 17, d: int = 64, n_layer: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(ToyBlock(d) for _ in range(n_layer))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(h)


@pytest.fixture
def toy():
    """Factory for fresh ToyLM models, so tests can build a model and an identical reference."""

    def make(**kwargs) -> ToyLM:
        torch.manual_seed(1)
        return ToyLM(**kwargs)

    return make


@pytest.fixture
def ids():
    return torch.randint(0, 17, (2, 5))
