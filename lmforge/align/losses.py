"""Every post-training formula as a pure function on tensors: log-probs, reward-model losses, DPO,
PPO (KL shaping, GAE, clipped surrogate, value loss), GRPO and SFT. The continual-learning
penalties (L2, EWC, distillation) are in `regularizers.py`.

Conventions (SPEC §10): logits [B, T, V] are already aligned with labels [B, T] — the caller passes
``logits[:, :-1]`` and ``labels = input_ids[:, 1:]`` — except ``sft_loss``, which takes unshifted
HF-style labels and shifts itself. Masks are 1 on real (completion) tokens and 0 elsewhere.
Means over tokens are masked means. Everything is computed in fp32.
"""

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
    logits: Tensor, labels: Tensor, mask: Tensor | None = None, ignore_index: int = -100
) -> Tensor:
    """Sum of log p(label_t) over positions where ``mask`` is 1 → [B] (the DPO sequence log-prob).

    ``mask`` defaults to ``labels != ignore_index``; pass the completion mask so prompt tokens
    do not count.
    """
    lp = token_logprobs(logits, labels, ignore_index)
    if mask is None:
        mask = labels != ignore_index
    return (lp * mask.to(lp.dtype)).sum(-1)


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
    r_chosen: Tensor, r_rejected: Tensor, margin: Tensor | float = 0.0, reduction: str = "mean"
) -> Tensor:
    """-log σ(r⁺ - r⁻ - margin): the pairwise reward-model loss (margin as in Llama 2)."""
    return _reduce(-F.logsigmoid(r_chosen.float() - r_rejected.float() - margin), reduction)


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


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: Tensor | float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO: -(1-ε)·log σ(βh) - ε·log σ(-βh), h = (π⁺ - ref⁺) - (π⁻ - ref⁻) → (loss, r⁺, r⁻).

    ε is label smoothing (conservative DPO, TRL's "sigmoid" loss); a soft preference label p ∈ [0,1]
    (probability that "chosen" really is preferred) is ε = 1 - p, per pair if a tensor. The
    returned implicit rewards β(π - ref) are detached, for logging. π = ref gives ln 2 for any β.
    """
    eps = torch.as_tensor(label_smoothing, dtype=torch.float32, device=policy_chosen_logps.device)
    if eps.min() < 0 or eps.max() > 1:
        raise ConfigError(f"label_smoothing must lie in [0, 1], got {label_smoothing}")
    chosen = policy_chosen_logps.float() - ref_chosen_logps.float()
    rejected = policy_rejected_logps.float() - ref_rejected_logps.float()
    z = beta * (chosen - rejected)
    losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    return losses.mean(), (beta * chosen).detach(), (beta * rejected).detach()


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


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    beta: float = 0.04,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO (DeepSeekMath): per token -min(o·A, clip(o)·A) + β·KL_k3(π‖π_ref), averaged over each
    completion's tokens, then over completions → (loss, {"kl", "clip_frac"}).

    ``advantages`` is per completion [B] (or per token [B, T]). ``old_logp=None`` means
    on-policy (old = logp.detach()), where o = 1 and the gradient is -A·∇log π.
    ``ref_logp=None`` or β=0 drops the KL term.
    """
    logp = logp.float()
    old = logp.detach() if old_logp is None else old_logp.float()
    adv = advantages.float()
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    ratio = torch.exp(logp - old)
    surrogate = clipped_surrogate(ratio, adv, clip_eps)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if ref_logp is not None and beta != 0:
        kl = kl_per_token(logp, ref_logp, "k3")
        per_token = per_token + beta * kl
    loss = masked_mean(per_token, mask, dim=-1).mean()
    with torch.no_grad():
        stats = {
            "kl": masked_mean(kl, mask),
            "clip_frac": masked_mean((surrogate < ratio * adv).float(), mask),
        }
    return loss, stats


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
