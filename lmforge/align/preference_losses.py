"""Preference-learning losses as pure functions on tensors: reward models (Bradley-Terry with
margin and centering, hinge, MSE gap, listwise, Plackett-Luce), DPO and its variants, ORPO,
CPO/SimPO and KTO, with the conventions of `logprobs.py` (where the log-prob helpers are).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.errors import ConfigError, LMForgeError, require_choice

# ----------------------------------------------------------------------------- reward models


def bradley_terry_loss(
    r_chosen: Tensor, r_rejected: Tensor, margin: Tensor | float = 0.0, center_coef: float = 0.0
) -> Tensor:
    """Mean -log σ(r⁺ - r⁻ - margin): the pairwise reward-model loss (margin as in Llama 2).

    ``center_coef`` c adds c·mean((r⁺ + r⁻)²) (Eisenstein et al. 2023; TRL's
    ``center_rewards_coefficient``): BT only fixes reward differences, this keeps the scale
    centred on 0.
    """
    rc, rr = r_chosen.float(), r_rejected.float()
    loss = -F.logsigmoid(rc - rr - margin).mean()
    return loss + center_coef * reward_centering(rc, rr) if center_coef else loss


def reward_centering(r_chosen: Tensor, r_rejected: Tensor) -> Tensor:
    """mean((r⁺ + r⁻)²): the auxiliary term that pulls a pairwise reward model's scores toward
    mean 0 (any pairwise loss only sees differences, so the offset would otherwise drift)."""
    return ((r_chosen.float() + r_rejected.float()) ** 2).mean()


def hinge_loss(r_chosen: Tensor, r_rejected: Tensor, margin: float = 1.0) -> Tensor:
    """Mean max(0, m - (r⁺ - r⁻)): zero once the chosen reward leads by at least the margin."""
    return F.relu(margin - (r_chosen.float() - r_rejected.float())).mean()


def mse_gap_loss(r_chosen: Tensor, r_rejected: Tensor, target_gap: Tensor | float) -> Tensor:
    """Mean (r⁺ - r⁻ - target)²: regress the reward gap onto a rated preference strength."""
    return ((r_chosen.float() - r_rejected.float() - target_gap) ** 2).mean()


def listwise_loss(scores: Tensor, best: Tensor) -> Tensor:
    """K-way softmax cross-entropy over scores [N, K]; ``best`` [N] is the winner's index."""
    if scores.dim() != 2:
        raise LMForgeError(f"scores must be [N, K], got {tuple(scores.shape)}")
    return F.cross_entropy(scores.float(), best.long())


def plackett_luce_loss(scores: Tensor, ranking: Tensor) -> Tensor:
    """Mean -log P(ranking) under Plackett-Luce: ranking [N, K] lists candidate indices best
    first.

    -Σ_k [s_{π_k} - log Σ_{j≥k} exp s_{π_j}]; with K=2 this is exactly the Bradley-Terry loss.
    """
    if scores.dim() != 2 or ranking.shape != scores.shape:
        raise LMForgeError(f"scores and ranking must both be [N, K], got {tuple(scores.shape)}")
    s = scores.float().gather(1, ranking.long())
    suffix_lse = torch.logcumsumexp(s.flip(-1), dim=-1).flip(-1)
    return -(s - suffix_lse).sum(-1).mean()


def preference_accuracy(r_chosen: Tensor, r_rejected: Tensor) -> Tensor:
    """Fraction of pairs where the chosen response gets the strictly higher reward."""
    return (r_chosen > r_rejected).float().mean()


# ----------------------------------------------------------------------------- DPO


DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: Tensor | float = 0.0,
    loss_type: str = "sigmoid",
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO and its variants on h = (π⁺ - ref⁺) - (π⁻ - ref⁻) (sequence log-probs) → (loss, r⁺, r⁻).

    ``loss_type`` (the names and formulas of TRL's ``DPOConfig.loss_type``):

    - ``sigmoid``: -(1-ε)·log σ(βh) - ε·log σ(-βh). ε is label smoothing (conservative DPO); a
      soft preference label p ∈ [0,1] (chance that "chosen" really is preferred) is ε = 1 - p, per
      pair if a tensor. With ε = 0 this is TRL's ``sigmoid``; TRL ≥ 1.0 ignores ε there (it
      moved smoothing to ``robust``/``exo_pair``), we keep the label variant (conservative DPO,
      Mitchell 2023, "A note on DPO with noisy preferences").
    - ``robust`` (Chowdhury et al. 2024): [-(1-ε)·log σ(βh) + ε·log σ(-βh)] / (1 - 2ε), an
      unbiased loss under labels flipped with probability ε ∈ [0, 0.5).
    - ``hinge`` (SLiC): max(0, 1 - βh).
    - ``ipo`` (Azar et al. 2023): (h_len - 1/(2β))² where each log-ratio is divided by its
      completion length (``chosen_lengths``/``rejected_lengths``, required) — the length
      normalisation TRL confirmed with the IPO authors; here β is the paper's τ.

    The returned implicit rewards β(π - ref) are detached, for logging. π = ref gives ln 2 for
    ``sigmoid`` with any β.
    """
    require_choice("DPO loss_type", loss_type, DPO_LOSS_TYPES)
    eps = torch.as_tensor(label_smoothing, dtype=torch.float32, device=policy_chosen_logps.device)
    if eps.min() < 0 or eps.max() > 1:
        raise ConfigError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    chosen = policy_chosen_logps.float() - ref_chosen_logps.float()
    rejected = policy_rejected_logps.float() - ref_rejected_logps.float()
    h = chosen - rejected
    if loss_type == "robust" and eps.max() >= 0.5:
        raise ConfigError(f"robust DPO needs label_smoothing in [0, 0.5), got {label_smoothing}")
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ConfigError("IPO needs chosen_lengths and rejected_lengths (completion tokens)")
        c_len, r_len = chosen_lengths.float().clamp_min(1), rejected_lengths.float().clamp_min(1)
        h = chosen / c_len - rejected / r_len
    losses = margin_losses(h, beta, loss_type, eps)
    return losses.mean(), (beta * chosen).detach(), (beta * rejected).detach()


def margin_losses(d: Tensor, beta: float, loss_type: str, eps: Tensor | float = 0.0) -> Tensor:
    """Per-pair losses on a log-prob difference d, shared by DPO and CPO/SimPO: ``sigmoid``
    -(1-ε)·log σ(βd) - ε·log σ(-βd) (``simpo`` too), ``robust`` its unbiased form under flipped
    labels, ``hinge`` max(0, 1 - βd), ``ipo`` (d - 1/(2β))²."""
    z = beta * d
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return F.relu(1 - z)
    if loss_type == "ipo":
        return (d - 1 / (2 * beta)) ** 2
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


# ----------------------------------------------------------------------------- ORPO, CPO/SimPO, KTO


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2 (Mächler 2012)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_logps: Tensor, rejected_logps: Tensor, chosen_nll: Tensor, beta: float = 0.1
) -> tuple[Tensor, Tensor]:
    """ORPO (Hong et al. 2024): NLL(chosen) - β·mean log σ(log odds(y⁺) - log odds(y⁻)) → (loss,
    log-odds ratio per pair, detached).

    odds(y) = P/(1-P) with P = exp of the *length-averaged* log-prob (``sequence_logprobs(...,
    average=True)``), so log odds = logp - log(1 - exp(logp)). No reference model. ``chosen_nll``
    is the caller's SFT term: TRL's ORPOTrainer (and its oracle test here) takes the mean
    next-token loss over the whole chosen sequence, prompt included.
    """
    c, r = chosen_logps.float(), rejected_logps.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    return chosen_nll - beta * F.logsigmoid(log_odds).mean(), log_odds.detach()


CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def cpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> Tensor:
    """Reference-free preference losses on d = logπ(y⁺) - logπ(y⁻) (TRL's CPOTrainer.cpo_loss):
    ``sigmoid`` (CPO, Xu et al. 2024) -(1-ε)·log σ(βd) - ε·log σ(-βd); ``simpo`` the same with
    d - γ/β (Meng et al. 2024: target margin γ); ``hinge`` max(0, 1 - βd); ``ipo``
    (d - 1/(2β))². SimPO and ipo expect length-averaged log-probs (``average=True``), CPO and
    hinge summed ones. Mean over pairs; CPO's ``cpo_alpha``·NLL term is added by the caller.
    """
    require_choice("CPO loss_type", loss_type, CPO_LOSS_TYPES)
    margin = simpo_gamma / beta if loss_type == "simpo" else 0.0  # SimPO's target margin γ/β
    d = chosen_logps.float() - rejected_logps.float() - margin
    return margin_losses(d, beta, loss_type, label_smoothing).mean()


KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl_logps: Tensor | None = None,
    ref_kl_logps: Tensor | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[Tensor, Tensor]:
    """KTO (Ethayarajh et al. 2024) on unpaired examples → (loss, reference point z₀).

    r = logπ(y|x) - logπ_ref(y|x) (sequence sums); desirable rows cost λ_D·(1 - σ(β(r - z₀))),
    undesirable ones λ_U·(1 - σ(β(z₀ - r))); the loss is the mean over all rows. z₀ estimates
    KL(π‖π_ref) from mismatched (prompt, other completion) pairs: max(0, mean(kl_logps -
    ref_kl_logps)), detached (TRL's estimate; None or missing KL rows give z₀ = 0).
    ``apo_zero_unpaired`` (APO, D'Oosterlinck et al. 2024): 1 - σ(βr) and σ(βr), which is
    the KTO loss with z₀ = 0.
    """
    require_choice("KTO loss_type", loss_type, KTO_LOSS_TYPES)
    r = policy_logps.float() - ref_logps.float()
    good = desirable.bool()
    z0 = torch.zeros((), device=r.device)
    if loss_type == "kto" and kl_logps is not None and ref_kl_logps is not None:
        z0 = (kl_logps.float() - ref_kl_logps.float()).mean().detach().clamp(min=0)
    chosen = 1 - torch.sigmoid(beta * (r[good] - z0))
    rejected = 1 - torch.sigmoid(beta * (z0 - r[~good]))
    losses = torch.cat([desirable_weight * chosen, undesirable_weight * rejected])
    return losses.mean(), z0
