"""AdamW with the usual decay/no-decay split, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn


def build_adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """Decay matrices and embeddings; never biases or norm gains (nanoGPT/GPT-3 practice).

    Uses the fused kernel (one call updates every parameter), available on CPU and GPU.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)


def cosine_lr(it: int, lr: float, min_lr: float, warmup: int, decay_iters: int) -> float:
    """Linear warmup to lr over `warmup` steps, cosine decay to min_lr at decay_iters, then flat."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / max(1, decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


class LossScaler:
    """Dynamic loss scaling for fp16: multiply the loss by S, unscale grads, skip steps on inf.

    S doubles after `growth_interval` clean steps and halves on overflow (torch.amp.GradScaler
    does the same; this one is spelled out and works on any device).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale = init_scale
        self.growth_interval = growth_interval
        self._clean_steps = 0

    def unscale_and_check(self, params) -> bool:
        """Divide grads by S; return True when all are finite (the step may proceed)."""
        grads = [p.grad for p in params if p.grad is not None]
        for g in grads:
            g.div_(self.scale)
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        self._clean_steps = self._clean_steps + 1 if finite else 0
        if not finite:
            self.scale /= 2.0
        elif self._clean_steps >= self.growth_interval:
            self.scale *= 2.0
            self._clean_steps = 0
        return finite

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self._clean_steps = state["scale"], state["clean_steps"]
