"""Reinforcement-learning losses as pure functions on tensors: KL estimators and reward shaping,
GAE, PPO's clipped policy and value losses, KL controllers, GRPO and its variants (BNPO, Dr. GRPO,
DAPO), truncation masking and RLOO, with the conventions of `logprobs.py` (where the log-prob
helpers are)."""

import torch
from torch import Tensor

from lmforge.align.logprobs import last_index, masked_mean
from lmforge.errors import ConfigError, LMForgeError, require_choice

# ----------------------------------------------------------------------------- PPO / RLHF


# Schulman's estimators of KL(π‖π_ref) per sampled token, from d = log π - log π_ref
KL_ESTIMATORS = {
    "k1": lambda d: d,  # unbiased, can be negative (the RLHF reward penalty)
    "k2": lambda d: 0.5 * d**2,
    "k3": lambda d: torch.expm1(-d) + d,  # exp(-d) - 1 + d: unbiased and ≥ 0 (GRPO)
}


def kl_per_token(logp: Tensor, ref_logp: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from sampled-token log-probs (`KL_ESTIMATORS`)."""
    require_choice("KL estimator", estimator, KL_ESTIMATORS)
    return KL_ESTIMATORS[estimator](logp.float() - ref_logp.float())


def last_token_index(mask: Tensor) -> Tensor:
    """`last_index` of a mask in which every row has a real token (an episode that ends)."""
    last = last_index(mask)
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


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps: float = 0.2, eps_high: float | None = None
) -> Tensor:
    """PPO objective per token: min(o·Â, clip(o, 1-ε, 1+ε_high)·Â) (to be maximised); ε_high
    (DAPO's clip-higher) defaults to ε."""
    high = eps if eps_high is None else eps_high
    return torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + high) * advantages)


def ppo_policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked mean of -clipped_surrogate → (loss, {"clip_frac", "approx_kl"}) with detached stats:
    `grpo_loss`'s token mean (``bnpo``) with no KL term.

    ``advantages`` is [B, T] (or [B], one per sequence).
    ``approx_kl`` is ½·mean((log π - log π_old)²) as in TRL; ``clip_frac`` is the fraction of tokens
    where the clipped term was the smaller one.
    """
    loss, stats = grpo_loss(logp, old_logp, None, advantages, mask, clip_eps, 0.0, "bnpo")
    with torch.no_grad():
        approx_kl = 0.5 * masked_mean((logp.float() - old_logp.float()) ** 2, mask)
    return loss, {"clip_frac": stats["clip_frac"], "approx_kl": approx_kl}


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


ADVANTAGE_SCALES = ("std", "none")


def group_advantages(
    rewards: Tensor, group_size: int | None = None, scale: str = "std", eps: float = 1e-4
) -> Tensor:
    """A_i = r_i - mean of its group (÷ (std + eps) when scale="std", GRPO), same shape as input.

    ``rewards`` is [n_prompts, G], or flat [n_prompts·G] with consecutive groups of ``group_size``.
    The std is Bessel-corrected like TRL; a group of one gets advantage 0.
    """
    require_choice("scale", scale, ADVANTAGE_SCALES)
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
    DeepSeekMath formula, which earlier TRL releases use.
    """
    require_choice("GRPO loss_type", loss_type, GRPO_LOSS_TYPES)
    if loss_type == "dr_grpo" and not max_completion_length:
        raise ConfigError("loss_type dr_grpo needs max_completion_length")
    logp = logp.float()
    old = logp.detach() if old_logp is None else old_logp.float()
    adv = advantages.float().view(len(logp), -1)  # [B] -> [B, 1]
    ratio = torch.exp(logp - old)
    surrogate = clipped_surrogate(ratio, adv, clip_eps, clip_eps_high)
    kl = torch.zeros_like(logp)
    if ref_logp is not None and beta != 0:
        kl = kl_per_token(logp, ref_logp, "k3") * (ratio if kl_correction else 1)
    per_token = beta * kl - surrogate
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
        clip_frac = masked_mean((surrogate < ratio * adv).float(), m)
    return loss, {"kl": masked_mean(kl.detach(), m), "clip_frac": clip_frac}


def mask_truncated(completion_ids: Tensor, completion_mask: Tensor, stop_ids) -> Tensor:
    """Overlong filtering (DAPO; TRL's ``mask_truncated_completions``): zero the mask of every
    completion whose last real token is not a stop token — it was cut at the length limit, so its
    reward says nothing about a finished answer and must not be learned from.

    ``completion_mask`` [B, C] is 1 on generated tokens (stop token included); rows without real
    tokens are left as they are.
    """
    last = last_index(completion_mask)
    last_tok = completion_ids.gather(1, last.clamp_min(0).unsqueeze(1)).squeeze(1)
    finished = torch.isin(last_tok, completion_ids.new_tensor(list(stop_ids))) | (last < 0)
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
    ratio = torch.exp(seq - old)
    adv = advantages.float()
    surrogate = clipped_surrogate(ratio, adv, clip_eps, clip_eps_high)
    with torch.no_grad():
        stats = {"clip_frac": (surrogate < ratio * adv).float().mean()}
    return -surrogate.mean(), stats
