"""MoE training extras on top of moe.MoE (SPEC §4): expert capacity with drop-on-overflow, the
load-balancing loss, and DeepSeek-style shared experts.

- Capacity C = ⌊α·k·N/E⌋ token slots per expert for N tokens (SPEC Decision: with the k factor,
  so α = 1 fits perfectly balanced top-k routing). Assignments past C are dropped: that expert's
  contribution becomes 0 and the token passes through the residual. First choices claim slots
  before second choices (GShard/Switch priority), then token order. Batched: a cumsum over a
  one-hot of the assignments gives every assignment its slot, no loop over tokens.
- L_aux = E · Σ_e f_e · m_e, f_e = fraction of tokens routed to e (top-k, so Σ f = k),
  m_e = mean router probability of e. Uniform routing gives k, collapse onto one expert with
  k = 1 gives E. Stored as `aux_loss` (already × λ) after each training forward;
  Transformer.aux_loss() sums it over layers and the pretraining loop adds it to the loss.
- Shared experts: n_shared always-on SwiGLU experts added to every token's output.

With the defaults (no capacity, λ = 0, no shared experts) the output is exactly moe.MoE's,
so Mixtral checkpoints still give Hugging Face's logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lmforge.model.moe import MoE, Routing


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


class BalancedMoE(MoE):
    """moe.MoE plus capacity, load-balancing loss and shared experts (config mlp="moe")."""

    def __init__(self, d_model, d_ff, activation, bias, dropout, n_experts=8, top_k=2,
                 capacity_factor: float | None = None, aux_loss_weight: float = 0.0,
                 n_shared_experts: int = 0):  # fmt: skip
        from lmforge.model.mlp import GatedMLP  # mlp.py imports this module for its registry

        super().__init__(d_model, d_ff, activation, bias, dropout, n_experts, top_k)
        self.top_k, self.n_experts = top_k, n_experts
        self.capacity_factor, self.aux_loss_weight = capacity_factor, aux_loss_weight
        self.shared = None
        if n_shared_experts:
            self.shared = GatedMLP(d_model, d_ff * n_shared_experts, activation, bias, 0.0)
        self.aux_loss: torch.Tensor | None = None
        self.dropped_fraction = 0.0  # share of assignments dropped in the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
