"""Mixture of experts: a router picks `top_k` of `n_experts` feed-forward networks per token.

Routing follows Mixtral (and transformers' `MixtralSparseMoeBlock`) exactly, so converted
checkpoints give the same logits: P = softmax(W_r x) over *all* experts in fp32, keep the top-k
probabilities, renormalise them to sum to one (SPEC §4: P=[0.5, 0.3, 0.2], k=2 -> [0.625, 0.375]),
and return sum_e gate_e * expert_e(x). Tokens are dispatched in one batch per expert: the loop
runs over experts, never over tokens.

The pieces are separate on purpose: `Router` produces a `Routing` (logits, probabilities, chosen
experts, gates), which is everything a load-balancing loss needs; `MoE.dispatch` is the one place
that sends tokens to experts, where a capacity limit would drop overflow; shared experts would be
one more module added to the output in `MoE.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Routing:
    """The router's decision for N tokens over E experts."""

    logits: torch.Tensor  # [N, E] raw router scores
    probs: torch.Tensor  # [N, E] fp32 softmax over all experts
    experts: torch.Tensor  # [N, k] chosen expert ids, most probable first
    gates: torch.Tensor  # [N, k] fp32 weights of the chosen experts (sum to 1 if renormalised)


class Router(nn.Module):
    """A linear scorer followed by softmax, top-k and renormalisation over the chosen experts."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, renormalize: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, d_model] -> Routing."""
        logits = nn.functional.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        gates, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return Routing(logits, probs, experts, gates)


class MoE(nn.Module):
    """Sparse MoE feed-forward layer with SwiGLU experts (Mixtral's w1/w3/w2 = gate/up/down)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str,
        bias: bool,
        dropout: float,
        n_experts: int = 8,
        top_k: int = 2,
    ):
        from lmforge.model.mlp import GatedMLP  # mlp.py imports this module for its registry

        super().__init__()
        self.router = Router(d_model, n_experts, top_k)
        self.experts = nn.ModuleList(
            GatedMLP(d_model, d_ff, activation, bias, 0.0) for _ in range(n_experts)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]."""
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat)
        return self.dropout(self.dispatch(flat, routing).view_as(x))

    def dispatch(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Run each expert once on the tokens routed to it and add the gated outputs back."""
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(routing.experts == e)
            if token.numel() == 0:
                continue
            y = expert(flat[token]) * routing.gates[token, slot, None]
            # index_put_(accumulate) adds like index_add_ but skips its OpenMP region, which
            # stalls for tens of ms per call on an oversubscribed CPU (measured: 85 ms vs 2 us).
            out.index_put_((token,), y.to(out.dtype), accumulate=True)
        return out
