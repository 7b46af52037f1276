"""Mixture of experts: a router picks `top_k` of `n_experts` SwiGLU feed-forward networks per
token (config mlp="moe"), with the training extras of Switch Transformer (Fedus et al. 2021)
and DeepSeekMoE (Dai et al. 2024).

Routing follows Mixtral (and transformers' `MixtralSparseMoeBlock`) exactly, so converted
checkpoints give the same logits: P = softmax(W_r x) over *all* experts in fp32, keep the top-k
probabilities, renormalise them to sum to one (P=[0.5, 0.3, 0.2], k=2 -> [0.625, 0.375]),
and return sum_e gate_e * expert_e(x). Tokens are dispatched in one batch per expert: the loop
runs over experts, never over tokens.

The extras, all off by default (and then the output is plain Mixtral routing):

- Capacity C = ⌊α·k·N/E⌋ token slots per expert for N tokens (with the k factor, as GShard counts
  top-k slots, so α = 1 fits perfectly balanced top-k routing). Assignments past C are dropped: that
  expert's contribution becomes 0 and the token passes through the residual. First choices claim
  slots before second choices (GShard/Switch priority), then token order. Batched: a cumsum over a
  one-hot of the assignments gives every assignment its slot, no loop over tokens.
- L_aux = E · Σ_e f_e · m_e, f_e = fraction of tokens routed to e (top-k, so Σ f = k),
  m_e = mean router probability of e. Uniform routing gives k, collapse onto one expert with
  k = 1 gives E. Stored as `aux_loss` (already × λ) after each training forward;
  Transformer.aux_loss() sums it over layers and the pretraining loop adds it to the loss.
- Shared experts: n_shared always-on SwiGLU experts (DeepSeek) added to every token's output.

The pieces are separate on purpose: `Router` produces a `Routing` (logits, probabilities, chosen
experts, gates), which is everything the load-balancing loss needs; `apply_capacity` edits a
Routing; `MoE.dispatch` is the one place that sends tokens to experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.model.mlp import GatedMLP


@dataclass
class Routing:
    """The router's decision for N tokens over E experts."""

    logits: torch.Tensor  # [N, E] raw router scores
    probs: torch.Tensor  # [N, E] fp32 softmax over all experts
    experts: torch.Tensor  # [N, k] chosen expert ids, most probable first (-1: dropped)
    gates: torch.Tensor  # [N, k] fp32 weights of the chosen experts (renormalised: sum to 1)


class Router(nn.Module):
    """A linear scorer followed by softmax, top-k and renormalisation over the chosen experts."""

    def __init__(self, d_model: int, n_experts: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> Routing:
        """x [N, d_model] -> Routing."""
        logits = nn.functional.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        gates, experts = torch.topk(probs, self.top_k, dim=-1)
        return Routing(logits, probs, experts, gates / gates.sum(dim=-1, keepdim=True))


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """E · Σ_e f_e m_e for router probabilities [N, E] and chosen experts [N, k]."""
    n_experts = probs.shape[-1]
    f = F.one_hot(experts, n_experts).sum(1).float().mean(0)  # [E], sums to k
    m = probs.float().mean(0)  # [E], sums to 1
    return n_experts * (f * m).sum()


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, factor: float) -> int:
    """C = ⌊α·k·N/E⌋ (at least 1)."""
    return max(1, math.floor(factor * top_k * n_tokens / n_experts))


def apply_capacity(routing: Routing, capacity: int) -> tuple[Routing, torch.Tensor]:
    """Drop assignments beyond each expert's capacity: expert id -1, gate 0. Returns the new
    routing and the kept mask [N, k]."""
    n, k = routing.experts.shape
    n_experts = routing.probs.shape[-1]
    order = routing.experts.t().reshape(-1)  # slot-major: all first choices first
    one_hot = F.one_hot(order, n_experts)
    position = ((one_hot.cumsum(0) - 1) * one_hot).sum(-1)  # slot index within its expert
    kept = (position < capacity).view(k, n).t()
    experts = routing.experts.masked_fill(~kept, -1)
    gates = routing.gates * kept
    return Routing(routing.logits, routing.probs, experts, gates), kept


class MoE(nn.Module):
    """Sparse MoE feed-forward layer with SwiGLU experts (Mixtral's w1/w3/w2 = gate/up/down),
    optional expert capacity, load-balancing loss and shared experts."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str,
        bias: bool,
        dropout: float,
        n_experts: int = 8,
        top_k: int = 2,
        capacity_factor: float | None = None,
        aux_loss_weight: float = 0.0,
        n_shared_experts: int = 0,
    ):
        super().__init__()
        self.router = Router(d_model, n_experts, top_k)
        self.experts = nn.ModuleList(
            GatedMLP(d_model, d_ff, activation, bias, 0.0) for _ in range(n_experts)
        )
        self.dropout = nn.Dropout(dropout)
        self.top_k, self.n_experts = top_k, n_experts
        self.capacity_factor, self.aux_loss_weight = capacity_factor, aux_loss_weight
        self.shared = None
        if n_shared_experts:
            self.shared = GatedMLP(d_model, d_ff * n_shared_experts, activation, bias, 0.0)
        self.aux_loss: torch.Tensor | None = None
        self.dropped_fraction = 0.0  # share of assignments dropped in the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d_model] -> [B, T, d_model]; sets `aux_loss` and `dropped_fraction`."""
        flat = x.reshape(-1, x.shape[-1])
        routing = self.router(flat)
        self.aux_loss = None
        if self.training and self.aux_loss_weight > 0:
            self.aux_loss = self.aux_loss_weight * load_balancing_loss(
                routing.probs, routing.experts
            )
        if self.capacity_factor is not None:
            cap = expert_capacity(flat.shape[0], self.n_experts, self.top_k, self.capacity_factor)
            routing, kept = apply_capacity(routing, cap)
            self.dropped_fraction = 1.0 - kept.float().mean().item()
        out = self.dispatch(flat, routing)
        if self.shared is not None:
            out = out + self.shared(flat)
        return self.dropout(out.view_as(x))

    def dispatch(self, flat: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Run each expert once on the tokens routed to it and add the gated outputs back
        (dropped assignments, expert id -1, reach no expert)."""
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(routing.experts == e)
            if token.numel() == 0:
                continue
            y = expert(flat[token]) * routing.gates[token, slot, None]
            # index_put_(accumulate) adds like index_add_ but skips its OpenMP region, which
            # can stall for a long time on an oversubscribed CPU.
            out.index_put_((token,), y.to(out.dtype), accumulate=True)
        return out
