"""Every post-training formula as a pure function on tensors: log-probs, reward-model losses, DPO,
PPO (KL shaping, GAE, clipped surrogate, value loss), GRPO and SFT. The continual-learning
penalties (L2, EWC, distillation) are in `regularizers.py`.

Conventions (SPEC §10): logits [B, T, V] are already aligned with labels [B, T] — the caller passes
``logits[:, :-1]`` and ``labels = input_ids[:, 1:]`` — except ``sft_loss``, which takes unshifted
HF-style labels and shifts itself. Masks are 1 on real (completion) tokens and 0 elsewhere.
Means over tokens are masked means. Everything is computed in fp32.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.errors import ConfigError, LMForgeError

# ----------------------------------------------------------------------------- log-probs, masks


def _check_aligned(logits: Tensor, labels: Tensor) -> None:
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        shapes = f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        raise LMForgeError(f"logits must be [B, T, V] and labels [B, T]; got {shapes}")


def token_logprobs(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """log p(label_t) for every position, [B, T] in fp32; 0 where the label is ``ignore_index``.

    Uses logit[label] - logsumexp(logits), one row at a time, so the full [B, T, V] log-softmax is
    never materialised and at most one row is up-cast to fp32 (this is what dominates memory).
    """
    _check_aligned(logits, labels)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels)).unsqueeze(-1)
    rows = []
    for row_logits, row_labels in zip(logits, safe):
        row = row_logits.float()
        rows.append(row.gather(-1, row_labels).squeeze(-1) - torch.logsumexp(row, dim=-1))
    return torch.stack(rows) * valid


def sequence_logprobs(
    logits: Tensor,
    labels: Tensor,
    mask: Tensor | None = None,
    ignore_index: int = -100,
    average: bool = False,
) -> Tensor:
    """Sum of log p(label_t) over positions where ``mask`` is 1 → [B] (the DPO sequence log-prob).

    ``mask`` defaults to ``labels != ignore_index``; pass the completion mask so prompt tokens
    do not count. ``average=True`` divides by the number of counted tokens (the length-normalised
    log-prob of SimPO, ORPO and CPO's ipo).
    """
    lp = token_logprobs(logits, labels, ignore_index)
    if mask is None:
        mask = labels != ignore_index
    mask = mask.to(lp.dtype)
    total = (lp * mask).sum(-1)
    return total / mask.sum(-1).clamp_min(1) if average else total


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (weighted by mask); 0 if none are."""
    mask = mask.to(x.dtype)
    num = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    den = mask.sum() if dim is None else mask.sum(dim)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(x.dtype).tiny), num * 0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over masked positions (Bessel-corrected like TRL when ``unbiased``)."""
    var = masked_mean((x - masked_mean(x, mask)) ** 2, mask)
    n = mask.to(x.dtype).sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std with statistics from masked positions only (PPO advantage whitening).

    Unmasked positions are transformed too but do not influence the statistics. With
    ``shift_mean=False`` the mean is added back (TRL uses this for rewards).
    """
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


def _reduce(losses: Tensor, reduction: str) -> Tensor:
    if reduction not in ("mean", "sum", "none"):
        raise ConfigError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return losses if reduction == "none" else getattr(losses, reduction)()


# ----------------------------------------------------------------------------- reward models


def bradley_terry_loss(
    r_chosen: Tensor,
    r_rejected: Tensor,
    margin: Tensor | float = 0.0,
    reduction: str = "mean",
    center_coef: float = 0.0,
) -> Tensor:
    """-log σ(r⁺ - r⁻ - margin): the pairwise reward-model loss (margin as in Llama 2).

    ``center_coef`` c adds c·mean((r⁺ + r⁻)²) (Eisenstein et al. 2023; TRL's
    ``center_rewards_coefficient``): BT only fixes reward differences, this keeps the scale
    centred on 0. It needs a scalar, so it requires ``reduction="mean"``.
    """
    rc, rr = r_chosen.float(), r_rejected.float()
    loss = _reduce(-F.logsigmoid(rc - rr - margin), reduction)
    if center_coef:
        if reduction != "mean":
            raise ConfigError("center_coef needs reduction='mean'")
        loss = loss + center_coef * reward_centering(rc, rr)
    return loss


def reward_centering(r_chosen: Tensor, r_rejected: Tensor) -> Tensor:
    """mean((r⁺ + r⁻)²): the auxiliary term that pulls a pairwise reward model's scores toward
    mean 0 (any pairwise loss only sees differences, so the offset would otherwise drift)."""
    return ((r_chosen.float() + r_rejected.float()) ** 2).mean()


def hinge_loss(
    r_chosen: Tensor, r_rejected: Tensor, margin: float = 1.0, reduction: str = "mean"
) -> Tensor:
    """max(0, m - (r⁺ - r⁻)): zero once the chosen reward leads by at least the margin."""
    return _reduce(F.relu(margin - (r_chosen.float() - r_rejected.float())), reduction)


def mse_gap_loss(
    r_chosen: Tensor, r_rejected: Tensor, target_gap: Tensor | float, reduction: str = "mean"
) -> Tensor:
    """(r⁺ - r⁻ - target)²: regress the reward gap onto a rated preference strength."""
    return _reduce((r_chosen.float() - r_rejected.float() - target_gap) ** 2, reduction)


def listwise_loss(scores: Tensor, best: Tensor, reduction: str = "mean") -> Tensor:
    """K-way softmax cross-entropy over scores [N, K]; ``best`` [N] is the winner's index."""
    if scores.dim() != 2:
        raise LMForgeError(f"scores must be [N, K], got {tuple(scores.shape)}")
    return F.cross_entropy(scores.float(), best.long(), reduction=reduction)


def plackett_luce_loss(scores: Tensor, ranking: Tensor, reduction: str = "mean") -> Tensor:
    """-log P(ranking) under Plackett-Luce: ranking [N, K] lists candidate indices best first.

    -Σ_k [s_{π_k} - log Σ_{j≥k} exp s_{π_j}]; with K=2 this is exactly the Bradley-Terry loss.
    """
    if scores.dim() != 2 or ranking.shape != scores.shape:
        raise LMForgeError(f"scores and ranking must both be [N, K], got {tuple(scores.shape)}")
    s = scores.float().gather(1, ranking.long())
    suffix_lse = torch.logcumsumexp(s.flip(-1), dim=-1).flip(-1)
    return _reduce(-(s - suffix_lse).sum(-1), reduction)


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
      moved smoothing to ``robust``/``exo_pair``), we keep the SPEC's label variant.
    - ``robust`` (Chowdhury et al. 2024): [-(1-ε)·log σ(βh) + ε·log σ(-βh)] / (1 - 2ε), an
      unbiased loss under labels flipped with probability ε ∈ [0, 0.5).
    - ``hinge`` (SLiC): max(0, 1 - βh).
    - ``ipo`` (Azar et al. 2023): (h_len - 1/(2β))² where each log-ratio is divided by its
      completion length (``chosen_lengths``/``rejected_lengths``, required) — the length
      normalisation TRL confirmed with the IPO authors; here β is the paper's τ.

    The returned implicit rewards β(π - ref) are detached, for logging. π = ref gives ln 2 for
    ``sigmoid`` with any β.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ConfigError(
            f"DPO loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}"
        )
    eps = torch.as_tensor(label_smoothing, dtype=torch.float32, device=policy_chosen_logps.device)
    if eps.min() < 0 or eps.max() > 1:
        raise ConfigError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    chosen = policy_chosen_logps.float() - ref_chosen_logps.float()
    rejected = policy_rejected_logps.float() - ref_rejected_logps.float()
    z = beta * (chosen - rejected)
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    elif loss_type == "robust":
        if eps.max() >= 0.5:
            raise ConfigError(
                f"robust DPO needs label_smoothing in [0, 0.5), got {label_smoothing}"
            )
        losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = F.relu(1 - z)
    else:  # ipo
        if chosen_lengths is None or rejected_lengths is None:
            raise ConfigError("IPO needs chosen_lengths and rejected_lengths (completion tokens)")
        h = chosen / chosen_lengths.float().clamp_min(
            1
        ) - rejected / rejected_lengths.float().clamp_min(1)
        losses = (h - 1 / (2 * beta)) ** 2
    return losses.mean(), (beta * chosen).detach(), (beta * rejected).detach()


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
    if loss_type not in CPO_LOSS_TYPES:
        raise ConfigError(
            f"CPO loss_type must be one of {', '.join(CPO_LOSS_TYPES)}, got {loss_type!r}"
        )
    d = chosen_logps.float() - rejected_logps.float()
    if loss_type in ("sigmoid", "simpo"):
        if loss_type == "simpo":
            d = d - simpo_gamma / beta
        eps = label_smoothing
        losses = -(1 - eps) * F.logsigmoid(beta * d) - eps * F.logsigmoid(-beta * d)
    elif loss_type == "hinge":
        losses = F.relu(1 - beta * d)
    else:
        losses = (d - 1 / (2 * beta)) ** 2
    return losses.mean()


def simpo_loss(
    chosen_avg_logps: Tensor,
    rejected_avg_logps: Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> Tensor:
    """SimPO (Meng et al. 2024): -log σ(β(avg logπ(y⁺) - avg logπ(y⁻)) - γ), reference-free with
    length-averaged log-probs and a target reward margin γ (= ``cpo_loss(loss_type="simpo")``)."""
    return cpo_loss(chosen_avg_logps, rejected_avg_logps, beta, "simpo", label_smoothing, gamma)


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
    ``apo_zero_unpaired`` (APO, D'Oosterlinck et al. 2024): 1 - σ(βr) and σ(βr), no z₀.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ConfigError(
            f"KTO loss_type must be one of {', '.join(KTO_LOSS_TYPES)}, got {loss_type!r}"
        )
    r = policy_logps.float() - ref_logps.float()
    good = desirable.bool()
    z0 = torch.zeros((), device=r.device)
    if kl_logps is not None and ref_kl_logps is not None:
        z0 = (kl_logps.float() - ref_kl_logps.float()).mean().detach().clamp(min=0)
    if loss_type == "kto":
        chosen, rejected = (
            1 - torch.sigmoid(beta * (r[good] - z0)),
            1 - torch.sigmoid(beta * (z0 - r[~good])),
        )
    else:
        chosen, rejected = 1 - torch.sigmoid(beta * r[good]), torch.sigmoid(beta * r[~good])
    losses = torch.cat([desirable_weight * chosen, undesirable_weight * rejected])
    return losses.mean(), z0


# ----------------------------------------------------------------------------- PPO / RLHF


def kl_per_token(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

    k1 = log π - log π_ref (unbiased, can be negative; the RLHF reward penalty);
    k2 = ½(log π - log π_ref)²; k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased, ≥ 0; GRPO).
    """
    d = logp.float() - ref_logp.float()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ConfigError(f"KL estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last real token in each row of a [B, T] mask (works with left padding too)."""
    pos = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), pos, torch.full_like(pos, -1)).amax(-1)
    if (last < 0).any():
        raise LMForgeError("a row of the mask has no real tokens")
    return last


def shape_rewards(score: Tensor, kl: Tensor, mask: Tensor, beta: Tensor | float) -> Tensor:
    """Per-token RLHF rewards r_t = -β·KL_t on real tokens, plus the score at the last real one."""
    rewards = -beta * kl.float() * mask.float()
    last = last_token_index(mask)
    return rewards.scatter_add(1, last.unsqueeze(1), score.float().reshape(-1, 1))


def dones_from_mask(mask: Tensor) -> Tensor:
    """done_t = 1 at the last real token of each row, 0 elsewhere: the episode ends there."""
    dones = torch.zeros(mask.shape, device=mask.device)
    return dones.scatter(1, last_token_index(mask).unsqueeze(1), 1.0)


def gae(
    rewards: Tensor,
    values: Tensor,
    dones: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    next_value: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over [B, T] → (advantages, returns = Â + V).

    δ_t = r_t + γ(1-done_t)V_{t+1} - V_t and Â_t = δ_t + γλ(1-done_t)Â_{t+1}, with Â one past the
    end = 0 and V one past the end = ``next_value`` (0 by default; pass it for truncated rollouts).
    A reverse scan over time, vectorised over the batch. For LM rollouts pass
    ``dones_from_mask(mask)`` and mask the outputs.
    """
    if not (rewards.shape == values.shape == dones.shape) or rewards.dim() != 2:
        raise LMForgeError(
            f"rewards, values and dones must share one [B, T] shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(dones.shape)}"
        )
    rewards, values = rewards.float(), values.float()
    notdone = 1.0 - dones.float()
    next_v = torch.zeros_like(values[:, 0]) if next_value is None else next_value.float()
    next_adv = torch.zeros_like(next_v)
    advs = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * notdone[:, t] * next_v - values[:, t]
        next_adv = delta + gamma * lam * notdone[:, t] * next_adv
        next_v = values[:, t]
        advs.append(next_adv)
    advantages = torch.stack(advs[::-1], dim=1)
    return advantages, advantages + values


def clipped_surrogate(ratio: Tensor, advantages: Tensor, eps: float = 0.2) -> Tensor:
    """PPO objective per token: min(o·Â, clip(o, 1-ε, 1+ε)·Â) (to be maximised)."""
    return torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)


def ppo_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked mean of -clipped_surrogate → (loss, {"clip_frac", "approx_kl"}) with detached stats.

    ``advantages`` is [B, T] (or [B], one per sequence).
    ``approx_kl`` is ½·mean((log π - log π_old)²) as in TRL; ``clip_frac`` is the fraction of tokens
    where the clipped term was the smaller one.
    """
    if advantages.dim() == 1 and logp.dim() == 2:
        advantages = advantages.unsqueeze(-1)  # one advantage per sequence
    d = logp.float() - old_logp.float()
    ratio = torch.exp(d)
    unclipped = ratio * advantages
    surrogate = clipped_surrogate(ratio, advantages, clip_eps)
    loss = masked_mean(-surrogate, mask)
    with torch.no_grad():
        clip_frac = masked_mean((surrogate < unclipped).float(), mask)
        approx_kl = 0.5 * masked_mean(d**2, mask)
    return loss, {"clip_frac": clip_frac, "approx_kl": approx_kl}


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = None,
) -> Tensor:
    """½·masked mean of (V - G)², or of max((V - G)², (V_clip - G)²) with V_clip within ±clip_range
    of the rollout values (PPO value clipping)."""
    values = values.float()
    err = (values - returns) ** 2
    if clip_range is not None:
        clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * masked_mean(err, mask)


def entropy_from_logits(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Entropy of the next-token distribution [B, T]; its masked mean (scalar) if ``mask`` given."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    ent = torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
    return ent if mask is None else masked_mean(ent, mask)


class FixedKLController:
    """A constant KL coefficient β (the interface the PPO trainer talks to)."""

    def __init__(self, beta: float):
        self.value = beta

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Ziegler et al. (2019) proportional controller steering the measured KL toward ``target``.

    β ← β·(1 + clip(KL/target - 1, -0.2, 0.2)·n_steps/horizon), as in TRL.
    """

    def __init__(self, init_beta: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ConfigError(f"KL target and horizon must be > 0, got {target}, {horizon}")
        self.value, self.target, self.horizon = init_beta, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β after ``n_steps`` samples with mean KL ``current_kl``."""
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


# ----------------------------------------------------------------------------- GRPO / RLVR


def group_advantages(
    rewards: Tensor, group_size: int | None = None, scale: str = "std", eps: float = 1e-4
) -> Tensor:
    """A_i = r_i - mean of its group (÷ (std + eps) when scale="std", GRPO), same shape as input.

    ``rewards`` is [n_prompts, G], or flat [n_prompts·G] with consecutive groups of ``group_size``.
    The std is Bessel-corrected like TRL; a group of one gets advantage 0.
    """
    if scale not in ("std", "none"):
        raise ConfigError(f"scale must be 'std' or 'none', got {scale!r}")
    if rewards.dim() == 1:
        if not group_size or rewards.numel() % group_size:
            raise ConfigError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
        grouped = rewards.float().view(-1, group_size)
    elif rewards.dim() == 2:
        grouped = rewards.float()
    else:
        raise LMForgeError(f"rewards must be 1-D or [n_prompts, G], got {tuple(rewards.shape)}")
    adv = grouped - grouped.mean(-1, keepdim=True)
    if scale == "std" and grouped.shape[1] > 1:
        adv = adv / (grouped.std(-1, keepdim=True) + eps)
    return adv.view(rewards.shape)


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.04,
    loss_type: str = "grpo",
    clip_eps_high: float | None = None,
    max_completion_length: int | None = None,
    num_items: Tensor | float | None = None,
    kl_correction: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO (DeepSeekMath) and its variants: per token ℓ_t = -min(o·A, clip(o, 1-ε, 1+ε_high)·A)
    + β·KL_k3(π‖π_ref) → (loss, {"kl", "clip_frac"}).

    ``loss_type`` chooses how ℓ_t is reduced (TRL's ``GRPOConfig.loss_type``):

    - ``grpo``: mean over each completion's tokens, then over completions (long completions
      count as much as short ones, so each of their tokens counts less);
    - ``bnpo``: mean over every real token of the batch;
    - ``dr_grpo`` (Dr. GRPO, Liu et al. 2025): Σ ℓ_t / (B·``max_completion_length``), a
      constant denominator, so there is no length bias at all;
    - ``dapo`` (Yu et al. 2025): Σ ℓ_t / ``num_items``, the number of real tokens in the whole
      *generation* batch (defaults to this batch's, i.e. ``bnpo``): minibatches of one rollout
      then add up to its token-level mean.

    ``clip_eps_high`` (DAPO's clip-higher, TRL's ``epsilon_high``; default = ``clip_eps``)
    widens the upper ratio bound so low-probability tokens with A > 0 can still grow.
    ``advantages`` is per completion [B] (or per token [B, T]). ``old_logp=None`` means
    on-policy (old = logp.detach()), where o = 1 and the gradient is -A·∇log π.
    ``ref_logp=None`` or β=0 drops the KL term. ``kl_correction`` multiplies KL_k3 by the
    (differentiable) ratio o (DeepSeek-V3.2; TRL's ``use_bias_correction_kl``, on by default in
    TRL 1.x): then the KL gradient is the unbiased gradient of KL(π‖π_ref) — without it, even
    on-policy, E[∇k3] is the gradient of the *forward* KL(π_ref‖π). Off by default here: the
    DeepSeekMath formula, which the SPEC's GRPO line and earlier TRL releases use.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ConfigError(
            f"GRPO loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}, got {loss_type!r}"
        )
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ConfigError("loss_type dr_grpo needs max_completion_length")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    logp = logp.float()
    old = logp.detach() if old_logp is None else old_logp.float()
    adv = advantages.float()
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old)
    unclipped = ratio * adv
    surrogate = torch.minimum(unclipped, ratio.clamp(1 - clip_eps, 1 + high) * adv)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if ref_logp is not None and beta != 0:
        kl = kl_per_token(logp, ref_logp, "k3")
        if kl_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
    m = mask.to(per_token.dtype)
    if loss_type == "grpo":
        loss = masked_mean(per_token, m, dim=-1).mean()
    elif loss_type == "bnpo":
        loss = (per_token * m).sum() / m.sum().clamp_min(1)
    elif loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (per_token.shape[0] * max_completion_length)
    else:  # dapo
        n = m.sum() if num_items is None else torch.as_tensor(num_items, dtype=m.dtype)
        loss = (per_token * m).sum() / n.clamp_min(1)
    with torch.no_grad():
        stats = {
            "kl": masked_mean(kl, m),
            "clip_frac": masked_mean((surrogate < unclipped).float(), m),
        }
    return loss, stats


def mask_truncated(completion_ids: Tensor, completion_mask: Tensor, stop_ids) -> Tensor:
    """Overlong filtering (DAPO; TRL's ``mask_truncated_completions``): zero the mask of every
    completion whose last real token is not a stop token — it was cut at the length limit, so its
    reward says nothing about a finished answer and must not be learned from.

    ``completion_mask`` [B, C] is 1 on generated tokens (stop token included); rows without real
    tokens are left as they are.
    """
    m = completion_mask.bool()
    last = torch.where(m, torch.arange(m.shape[1], device=m.device), -1).amax(-1)
    last_tok = completion_ids.gather(1, last.clamp_min(0).unsqueeze(1)).squeeze(1)
    stops = torch.as_tensor(
        list(stop_ids), dtype=completion_ids.dtype, device=completion_ids.device
    )
    finished = torch.isin(last_tok, stops) | (last < 0)
    return completion_mask * finished.unsqueeze(1).to(completion_mask.dtype)


def rloo_advantages(
    rewards: Tensor,
    group_size: int,
    normalize: bool = False,
    kl: Tensor | None = None,
    beta: float = 0.0,
) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): A_i = r_i - mean_{j≠i} r_j within each group
    of ``group_size`` consecutive completions → [B].

    ``kl`` [B] (Σ_t log π_old - log π_ref over the completion, the k1 estimate) is charged to the
    reward first, r ← r - β·kl, as TRL's RLOOTrainer does; ``normalize`` then whitens the
    advantages over the batch ((A - mean)/(std + 1e-4), Bessel-corrected std).
    """
    if group_size < 2 or rewards.dim() != 1 or rewards.numel() % group_size:
        raise ConfigError(
            f"{rewards.numel()} rewards do not split into groups of {group_size} >= 2"
        )
    r = rewards.float()
    if kl is not None and beta:
        r = r - beta * kl.float()
    grouped = r.view(-1, group_size)
    baseline = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)
    adv = (grouped - baseline).view(-1)
    if normalize:
        adv = (adv - adv.mean()) / (adv.std() + 1e-4)
    return adv


def rloo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """RLOO's sequence-level clipped objective (TRL's RLOOTrainer): o = π(y)/π_old(y) from log-probs
    summed over each completion's real tokens, loss = mean_i -min(o_i·A_i, clip(o_i)·A_i)
    → (loss, {"clip_frac"}). With ``old_logp=None`` (on-policy) o = 1 and the gradient is
    -A·∇log π(y), plain REINFORCE with the leave-one-out baseline.
    """
    m = mask.to(torch.float32)
    seq = (logp.float() * m).sum(-1)
    old = seq.detach() if old_logp is None else (old_logp.float() * m).sum(-1)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(seq - old)
    adv = advantages.float()
    unclipped = ratio * adv
    surrogate = torch.minimum(unclipped, ratio.clamp(1 - clip_eps, 1 + high) * adv)
    with torch.no_grad():
        stats = {"clip_frac": (surrogate < unclipped).float().mean()}
    return -surrogate.mean(), stats


# ----------------------------------------------------------------------------- SFT


def sft_loss(
    logits: Tensor, labels: Tensor, ignore_index: int = -100, label_smoothing: float = 0.0
) -> Tensor:
    """Next-token cross-entropy on response tokens, mean over the tokens that count.

    ``labels`` are HF-style and unshifted (a copy of input_ids with prompt and padding positions
    set to ``ignore_index``); this function shifts: logits[:, t] predicts labels[:, t+1].
    """
    _check_aligned(logits, labels)
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    if not (labels != ignore_index).any():
        return logits.sum() * 0.0  # nothing to learn from, but keep the graph for backward()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
    )
