"""Optimizers and learning-rate schedules.

- AdamW with the usual decay/no-decay split (`build_optimizer`).
- Muon (`Muon`, `build_optimizer(..., "muon")`): momentum SGD whose update for each hidden
  weight matrix is orthogonalised by a Newton-Schulz iteration, with AdamW for everything else
  (embeddings, the output head, norm gains, biases). K. Jordan et al., "Muon: An optimizer for
  hidden layers in neural networks" (2024), https://kellerjordan.github.io/posts/muon/ ; the
  modded-nanogpt speedrun records.
- Schedules: linear warmup then cosine decay (`cosine_lr`, nanoGPT), or warmup-stable-decay
  (`wsd_lr`: flat, then a linear cooldown over the last fraction; Hu et al. 2024, "MiniCPM").
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from lmforge.errors import ConfigError, require_choice

OPTIMIZERS = ("adamw", "muon")
# Muon's per-matrix lr factor for an [m, n] matrix: "original" sqrt(max(1, m/n)) (Jordan et
# al.); "match_rms_adamw" 0.2 sqrt(max(m, n)), an update RMS like AdamW's so that AdamW's lr and
# weight decay carry over (Liu et al. 2025, "Muon is Scalable for LLM Training", Moonlight)
MUON_LR_ADJUST = ("original", "match_rms_adamw")
SCHEDULES = ("cosine", "wsd")
# Newton-Schulz quintic coefficients (a, b, c) of X <- aX + b(XX^T)X + c(XX^T)^2 X, chosen to
# push every singular value into ~[0.7, 1.2] in 5 steps (Jordan et al. 2024)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def wsd_lr(
    it: int, lr: float, min_lr: float, warmup: int, decay_iters: int, cooldown_frac: float
) -> float:
    """Warmup-stable-decay: the same linear warmup as `cosine_lr`, then lr until the last
    `cooldown_frac` of decay_iters, then a straight line down to min_lr at decay_iters; flat
    after."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it >= decay_iters:
        return min_lr
    cooldown = max(1, round(cooldown_frac * decay_iters))
    start = decay_iters - cooldown
    if it < start:
        return lr
    return lr + (min_lr - lr) * (it - start) / cooldown


def cosine_lr(it: int, lr: float, min_lr: float, warmup: int, decay_iters: int) -> float:
    """Linear warmup to lr over `warmup` steps, cosine decay to min_lr at decay_iters, then flat."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / max(1, decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """An approximate orthogonalisation of `g` ([..., m, n], a batch of matrices): U S' V^T
    where g = U S V^T and S' ~ 1 (each singular value s mapped by a fixed odd polynomial to
    within ~[0.7, 1.2]), by `steps` quintic Newton-Schulz iterations after scaling g to unit
    Frobenius norm. Runs in g's dtype (fp32 on a CPU: bf16 matmuls are slow without AMX)."""
    x = g / (g.norm(dim=(-2, -1), keepdim=True) + eps)
    wide = x.size(-2) <= x.size(-1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.mT


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `muon=True`, AdamW for the others, in one optimizer (one
    state_dict, one `step`, the loop's lr schedule scaling every group through `lr_scale`).

    A Muon group's update: buf <- mu buf + (1 - mu) g; u = g + mu (buf - g) with Nesterov, else
    buf; W <- (1 - lr wd) W - lr f(m, n) NS(u) for each [m, n] matrix, f per `lr_adjust`
    (MUON_LR_ADJUST). Matrices of the same shape are orthogonalised together (one batched
    Newton-Schulz). torch.optim.Muon computes the same update (tests/train/test_optim.py).
    """

    def __init__(
        self, groups: list[dict[str, Any]], lr: float = 0.02, momentum: float = 0.95,
        nesterov: bool = True, ns_steps: int = 5, betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-8, weight_decay: float = 0.0, lr_adjust: str = "original",
    ):  # fmt: skip
        require_choice("muon_lr_adjust", lr_adjust, MUON_LR_ADJUST)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        betas=betas, eps=eps, weight_decay=weight_decay, muon=False,
                        lr_adjust=lr_adjust)  # fmt: skip
        super().__init__(groups, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ConfigError("Muon updates 2-D matrices only; put the others in AdamW groups")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                (self._muon if group["muon"] else self._adamw)(group, params)
        return loss

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
        for p in params:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        for (m, n), same in by_shape.items():
            grads = [p.grad for p in same]
            bufs = []
            for p in same:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(self.state[p]["momentum_buffer"])
            torch._foreach_lerp_(bufs, grads, 1 - mu)
            updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
            ortho = newton_schulz(torch.stack(updates), group["ns_steps"])
            if wd:
                torch._foreach_mul_(same, 1 - lr * wd)
            original = group["lr_adjust"] == "original"  # else match_rms_adamw
            factor = max(1.0, m / n) ** 0.5 if original else 0.2 * max(m, n) ** 0.5
            torch._foreach_add_(same, list(ortho.unbind(0)), alpha=-lr * factor)

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """torch.optim.AdamW's update, through its functional form, on the state kept here."""
        for p in params:
            if not self.state[p]:
                self.state[p].update(step=torch.zeros(()), exp_avg=torch.zeros_like(p),
                                     exp_avg_sq=torch.zeros_like(p))  # fmt: skip
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
              [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=True,
              amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)  # fmt: skip


def hidden_matrices(model: nn.Module) -> set[int]:
    """ids of the parameters Muon should update: the weight matrices of the nn.Linear layers,
    except an output head (a module named lm_head) and any matrix tied to an embedding."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return {
        id(m.weight) for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.weight.requires_grad
        and name.rpartition(".")[2] != "lm_head" and id(m.weight) not in embeddings
    }  # fmt: skip


def build_optimizer(model: nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The optimizer `cfg` (a run's `cfg.optim`, train/config.py's OptimConfig) names
    (OPTIMIZERS). Every param group carries `lr_scale`, its learning rate over `lr`, so the
    schedule (which computes lr) moves all of them.

    muon: Muon at muon_lr with muon_weight_decay for the hidden matrices (`hidden_matrices`),
    AdamW at lr for the rest (weight_decay on embeddings and the head, none on gains, biases).
    """
    require_choice("optimizer", cfg.optimizer, OPTIMIZERS)
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = hidden_matrices(model) if cfg.optimizer == "muon" else set()
    # decay matrices and embeddings, never biases or norm gains (nanoGPT/GPT-3 practice)
    groups = [
        {"params": [p for p in params if id(p) not in hidden and p.dim() >= 2],
         "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]  # fmt: skip
    betas = (cfg.beta1, cfg.beta2)
    if cfg.optimizer == "adamw":  # the fused kernel: one call updates every parameter
        optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, fused=True)
    else:
        muon = {"params": [p for p in params if id(p) in hidden], "muon": True,
                "lr": cfg.muon_lr, "lr_scale": cfg.muon_lr / cfg.lr,
                "weight_decay": cfg.muon_weight_decay}  # fmt: skip
        optimizer = Muon([g for g in (muon, *groups) if g["params"]], lr=cfg.lr,
                         momentum=cfg.muon_momentum, ns_steps=cfg.ns_steps, betas=betas,
                         lr_adjust=cfg.muon_lr_adjust)  # fmt: skip
    for group in optimizer.param_groups:
        group.setdefault("lr_scale", 1.0)
    return optimizer


class LossScaler:
    """Dynamic loss scaling for fp16: multiply the loss by S, unscale grads, skip steps on inf.

    S doubles after `growth_interval` clean steps and halves on overflow (torch.amp.GradScaler
    does the same; this one is spelled out and works on any device).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale, self.growth_interval = init_scale, growth_interval
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
