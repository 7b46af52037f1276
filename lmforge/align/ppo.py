"""PPO for RLHF (Ziegler et al. 2019, InstructGPT; TRL's PPOTrainer): reward minus β·KL per
token, GAE advantages, the clipped surrogate.

One step: sample completions, score each with the frozen reward (a reward model or a verifier),
and record π_old log-probs, π_ref log-probs and the critic's values — all fixed at rollout time.
Per-token rewards are r_t = -β·KL_t with KL_t = log π_old - log π_ref, plus the score R at the
last real token; GAE turns them into advantages (whitened over real tokens) and value targets
Â + V. Then `ppo_epochs` passes over shuffled minibatches minimise

    -min(o·Â, clip(o, 1±ε)·Â) + c_v·(clipped) value loss - c_e·entropy   (masked token means)

Variants, picked by `variant`:
  shaped   the KL is part of the reward (above); β fixed, or adaptive with `kl_target`.
  kl_loss  "PPO-KL": the reward is R alone and β·KL_k3(π‖π_ref) of the *current* policy is a loss
           term; β adapts toward `kl_target` (Schulman et al. 2017's adaptive-KL PPO).
Critics, picked by `critic`: `head` (a scalar head on the policy's own hidden states; with
`value_detach` the value loss trains the head only, so it cannot pull the shared trunk),
`separate` (a copy of the starting policy with its own head) or `reward` (a trainable copy of the
reward model scoring every prefix: TRL's default, it knows each prompt's typical score from step
one). `critic_warmup` steps train the critic alone before the policy moves.

Scores can be normalised with running moments (`score_norm`: scale / whiten, TRL's score
scaling): a Bradley–Terry head's scale is arbitrary and competes with β·KL in the shaped reward.

Train the reward model on the policy's own samples (reward.py `pairs_from: policy`): a reward
model trained on canned pairs barely separates the policy's right and wrong samples, so PPO has
nothing to climb (configs/align/ppo.yaml records the runs).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import Tensor, nn

from lmforge.align.logprobs import masked_mean, masked_whiten
from lmforge.align.rl import RLConfig, RLTrainer
from lmforge.align.rl_losses import (
    AdaptiveKLController,
    FixedKLController,
    dones_from_mask,
    gae,
    kl_per_token,
    ppo_policy_loss,
    ppo_value_loss,
    shape_rewards,
)
from lmforge.align.rollout import Rollout, ValueHead, completion_hidden, completion_stats
from lmforge.errors import ConfigError, require_choice, require_positive_ints
from lmforge.fileio import save_tensors
from lmforge.train.checkpoint import model_state
from lmforge.train.config import run_config

# ----------------------------------------------------------------------------- critics


class HeadCritic(nn.Module):
    """V(s_t) from the policy's own final hidden states (TRL's "value head" model).

    With ``detach`` the value loss trains the head only: on a shared trunk its gradient (often
    larger than the policy gradient, and pointing elsewhere) otherwise moves the policy too.
    """

    def __init__(self, policy: nn.Module, reward=None, detach: bool = True):
        super().__init__()
        self.head = ValueHead(policy.config.d_model)
        self.detach = detach

    def forward(self, hidden: Tensor, input_ids: Tensor, attention_mask: Tensor, start: int):
        return self.head(hidden.detach() if self.detach else hidden)


class SeparateCritic(nn.Module):
    """A critic with its own trunk, initialised as a copy of the starting policy."""

    def __init__(self, policy: nn.Module, reward=None, detach: bool = True):
        super().__init__()
        self.trunk = copy.deepcopy(policy).requires_grad_(True)
        self.head = ValueHead(policy.config.d_model)

    def forward(self, hidden: Tensor, input_ids: Tensor, attention_mask: Tensor, start: int):
        return self.head(completion_hidden(self.trunk, input_ids, attention_mask, start))


class RewardCritic(nn.Module):
    """A trainable copy of the reward model scoring every prefix (TRL's default critic).

    V(s_t) starts as the reward model's score of the text so far, so from the first step it
    already knows how each prompt tends to score: the prompt-to-prompt spread that a fresh value
    head would take hundreds of steps to learn, and that would otherwise swamp the advantages.
    Every pooling has a prefix form: `last`/`eos` read h_t, `mean` and `match` are running means.
    """

    def __init__(self, policy: nn.Module, reward=None, detach: bool = True):
        super().__init__()
        rm = getattr(reward, "model", None)
        if not all(hasattr(rm, a) for a in ("backbone", "head", "pooling")):
            raise ConfigError(
                "critic: reward needs a reward-model directory as --reward (got a verifier or "
                "a Python function); use critic: head or separate"
            )
        self.rm = copy.deepcopy(rm).train().requires_grad_(True)

    def forward(self, hidden: Tensor, input_ids: Tensor, attention_mask: Tensor, start: int):
        rm = self.rm
        mask = attention_mask.to(torch.float32).unsqueeze(-1)
        h = rm.backbone.norm(rm.backbone.hidden_states(input_ids, attention_mask))
        pooled = h  # last / eos: the prefix ends at t (no EOS inside a completion prefix)
        if rm.pooling == "mean":
            pooled = (h * mask).cumsum(1) / mask.cumsum(1).clamp(min=1)
        elif rm.pooling == "match":
            w = rm.backbone.lm_head.weight[input_ids[:, 1:]] * rm.backbone.output_scale
            both = mask[:, 1:] * mask[:, :-1]
            terms = nn.functional.pad(h[:, :-1] * w * both, (0, 0, 1, 0))
            pooled = terms.cumsum(1) / nn.functional.pad(both, (0, 0, 1, 0)).cumsum(1).clamp(min=1)
        return rm.head(pooled[:, start - 1 : -1]).squeeze(-1).float()


CRITICS = {"head": HeadCritic, "separate": SeparateCritic, "reward": RewardCritic}

# ----------------------------------------------------------------------------- KL placement

PPO_VARIANTS = ("shaped", "kl_loss")  # KL in the reward | KL_k3 as a loss term (module docstring)


def kl_penalty(variant: str, logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float) -> Tensor:
    """The KL loss term of the current policy: β·masked mean of KL_k3 for kl_loss, else 0."""
    if variant == "kl_loss":
        return beta * masked_mean(kl_per_token(logp, ref_logp, "k3"), mask)
    return logp.new_zeros(())


# ----------------------------------------------------------------------------- score scaling


class RunningMoments:
    """Mean and variance of every score seen so far (Chan et al.'s merge of batch moments)."""

    def __init__(self, mean: float = 0.0, var: float = 1.0, count: int = 0):
        self.mean, self.var, self.count = mean, var, count

    def update(self, x: Tensor) -> None:
        x = x.detach().double().flatten()
        n, m, v = x.numel(), x.mean().item(), x.var(unbiased=False).item()
        total = self.count + n
        delta = m - self.mean
        self.var = (self.var * self.count + v * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        return max(self.var, 1e-12) ** 0.5


# How a score enters the reward, given the running moments (updated with the batch first).
# A reward model's scale is arbitrary (a Bradley-Terry head may separate pairs by 0.05), and the
# score competes with β·KL in the shaped reward, so TRL offers the same two options.
SCORE_NORMS = {
    "none": lambda s, m: s,
    "scale": lambda s, m: s / m.std,  # TRL use_score_scaling
    "whiten": lambda s, m: (s - m.mean) / m.std,  # TRL use_score_scaling + use_score_norm
}


@run_config(optim=dict(lr=3e-5, min_lr=3e-5, max_iters=100))
class PPOConfig(RLConfig):
    """A PPO run (`lmforge ppo`). ``reward`` is usually a reward-model directory."""

    out_dir: str = "out/ppo"
    variant: str = "shaped"  # shaped (KL in the reward) | kl_loss (PPO-KL: KL as a loss term)
    critic: str = "head"  # head (value head on the policy) | separate (own trunk) | reward
    value_detach: bool = True  # critic: head: the value loss does not reach the policy trunk
    critic_warmup: int = 0  # first steps train the critic only (the policy waits for a baseline)
    kl_coef: float = 0.05  # β (initial β when adaptive)
    kl_target: float | None = None  # per-sequence KL to steer β toward; None = fixed β
    kl_horizon: int = 1000  # samples over which the adaptive controller moves β
    ppo_epochs: int = 4
    minibatch_size: int = 32  # rows per optimizer step
    clip_eps: float = 0.2
    value_clip: float | None = 0.2
    vf_coef: float = 0.1
    ent_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    score_norm: str = "none"  # none | scale (÷ running std) | whiten (- running mean, ÷ std)
    score_clip: float | None = None  # clip normalised scores to ±this
    batch_size: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("variant", self.variant, PPO_VARIANTS)
        require_choice("score_norm", self.score_norm, SCORE_NORMS)
        require_choice("critic", self.critic, CRITICS)
        if self.variant == "kl_loss" and self.kl_target is None:
            raise ConfigError("variant kl_loss (PPO-KL) adapts β toward kl_target: set --kl_target")
        require_positive_ints(self, "ppo_epochs", "minibatch_size")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ConfigError(f"gamma and lam must lie in [0, 1], got {self.gamma}, {self.lam}")


def ppo_advantages(
    rollout: Rollout,
    beta: float,
    variant: str,
    gamma: float,
    lam: float,
    whiten: bool,
    scores: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(advantages, returns, per-token KL) of a scored rollout with values and log-probs;
    ``scores`` replaces rollout.rewards (e.g. normalised) as the sequence-level score."""
    mask = rollout.completion_mask
    kl = kl_per_token(rollout.old_logprobs, rollout.ref_logprobs, "k1") * mask
    score = rollout.rewards if scores is None else scores
    rewards = shape_rewards(score, kl, mask, beta if variant == "shaped" else 0.0)
    advantages, returns = gae(rewards, rollout.values * mask, dones_from_mask(mask), gamma, lam)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns * mask, kl


class PPOTrainer(RLTrainer):
    """Policy + critic against a frozen reward and reference, KL-regularised."""

    name = "ppo"
    fsdp_own_loop = True  # losses through optimizer_step, rollouts from whole copies (rl.py)
    curves = [("train", "reward"), ("eval", "reward"), ("train", "kl"), ("train", "entropy"),
              ("train", "clip_frac"), ("train", "value_loss")]  # fmt: skip

    def setup(self) -> None:
        super().setup()  # the engine calls value_fn, hence the critic, only when it samples
        cfg: PPOConfig = self.cfg
        critic = CRITICS[cfg.critic](self.lm.model, self.reward, cfg.value_detach)
        self.critic = critic.to(self.device)
        if cfg.kl_target is None:
            self.kl_ctl = FixedKLController(cfg.kl_coef)
        else:
            self.kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        self.moments = RunningMoments()

    def value_fn(self, hidden: Tensor, r: Rollout) -> Tensor:
        """The critic's values of a rollout's completion tokens (the engine's value_fn)."""
        return self.critic(hidden, r.input_ids, r.attention_mask, r.prompt_width)

    def trainable_module(self) -> nn.Module:
        return nn.ModuleDict({"policy": self.lm.model, "critic": self.critic})

    def update(self, rollout: Rollout) -> dict[str, float]:
        cfg: PPOConfig = self.cfg
        beta = self.kl_ctl.value
        self.moments.update(rollout.rewards)
        scores = SCORE_NORMS[cfg.score_norm](rollout.rewards, self.moments)
        if cfg.score_clip is not None:
            scores = scores.clamp(-cfg.score_clip, cfg.score_clip)
        rollout.advantages, rollout.returns, kl = ppo_advantages(
            rollout, beta, cfg.variant, cfg.gamma, cfg.lam, cfg.whiten_advantages, scores
        )
        keys = ("loss", "policy_loss", "value_loss", "entropy", "clip_frac", "approx_kl")
        stats = self.minibatch_steps(rollout, cfg.ppo_epochs, cfg.minibatch_size,
                                     lambda mb: self._minibatch_loss(mb, beta), keys)  # fmt: skip
        seq_kl = kl.sum(-1).mean().item()  # KL(π_old‖π_ref) per completion, fixed at rollout
        self.kl_ctl.update(seq_kl, len(rollout))
        return {**stats, "kl": seq_kl, "kl_coef": beta}

    def _minibatch_loss(self, mb: Rollout, beta: float) -> tuple[Tensor, dict[str, float]]:
        cfg: PPOConfig = self.cfg
        mask = mb.completion_mask
        rows = (mb.input_ids, mb.attention_mask, mb.prompt_width)
        stats, hidden = completion_stats(self.lm.model, *rows, cfg.temperature, entropy=True)
        pg, pstats = ppo_policy_loss(stats.logp, mb.old_logprobs, mb.advantages, mask, cfg.clip_eps)
        vf = ppo_value_loss(self.critic(hidden, *rows), mb.values, mb.returns, mask, cfg.value_clip)
        entropy = masked_mean(stats.entropy, mask)
        penalty = kl_penalty(cfg.variant, stats.logp, mb.ref_logprobs, mask, beta)
        loss = cfg.vf_coef * vf
        if self.step >= cfg.critic_warmup:  # during warm-up only the critic learns
            loss = loss + pg - cfg.ent_coef * entropy + penalty
        logged = {"policy_loss": pg, "value_loss": vf, "entropy": entropy, **pstats}
        return loss, {k: v.item() for k, v in logged.items()}  # pstats: clip_frac, approx_kl

    def extra_state(self) -> dict:
        return {"kl_coef": self.kl_ctl.value, "score_moments": vars(self.moments)}

    def load_extra_state(self, state: dict) -> None:
        """A resumed run continues with the adapted β and score moments."""
        self.kl_ctl.value = float(state.get("kl_coef", self.kl_ctl.value))
        self.moments = RunningMoments(**state.get("score_moments", {}))

    def export(self, path: Path) -> None:
        super().export(path)
        save_tensors(Path(path) / "critic.safetensors", model_state(self.critic))
