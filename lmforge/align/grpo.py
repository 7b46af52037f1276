"""GRPO / RL from verifiable rewards (DeepSeekMath; TRL's GRPOTrainer).

Each step samples G completions for each of `batch_size` prompts with the KV-cache engine, scores
them with a verifier (exact answer match by default), and turns rewards into group-relative
advantages A_i = r_i - mean_group(r) (÷ std for GRPO's `scale: std`). The loss is
-mean(min(o·A, clip(o)·A)) over each completion's tokens, then over completions, plus
β·KL_k3(π‖π_ref) when β > 0. No value network: the group mean is the baseline.

`loss_type` picks TRL's reductions of that per-token loss (grpo, bnpo, dr_grpo, dapo: see
`rl_losses.grpo_loss`) or `rloo`, REINFORCE leave-one-out (`rl_losses.rloo_loss`, TRL's
RLOOTrainer). `clip_eps_high` is DAPO's clip-higher, `mask_truncated` its overlong filtering.

With `num_iterations` μ = 1 every update is on-policy (o = 1, the gradient is -A·∇log π and
π_old log-probs are never computed); μ > 1 reuses each batch μ times, which is what the ratio
clipping is for. A group whose rewards are all equal has zero advantage and contributes no
policy gradient.
"""

from __future__ import annotations

import torch

from lmforge.align.replay import ReplayConfig
from lmforge.align.rl import RLConfig, RLTrainer
from lmforge.align.rl_losses import (
    ADVANTAGE_SCALES,
    GRPO_LOSS_TYPES,
    group_advantages,
    grpo_loss,
    kl_per_token,
    mask_truncated,
    rloo_advantages,
    rloo_loss,
)
from lmforge.align.rollout import Rollout, completion_logprobs
from lmforge.align.tools import Calculator, ToolReward, ToolRolloutEngine
from lmforge.errors import ConfigError, require_choice, require_positive_ints
from lmforge.train.config import run_config, section


@run_config(optim=dict(lr=1e-4, max_iters=200))
class GRPOConfig(RLConfig):
    """A GRPO run (`lmforge grpo`)."""

    out_dir: str = "out/grpo"
    replay: ReplayConfig = section(ReplayConfig)
    group_size: int = 8
    scale: str = "std"  # std (GRPO: (r - mean)/std) | none (r - mean, Dr. GRPO / RLOO-style)
    beta: float = 0.0  # KL(π‖π_ref) coefficient; 0 skips the reference model entirely
    kl_correction: bool = False  # KL_k3 x ratio (unbiased reverse-KL gradient; TRL 1.x default)
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # DAPO clip-higher upper bound (None = clip_eps); 0.28
    loss_type: str = "grpo"  # grpo | bnpo | dr_grpo | dapo | rloo (see the module docstring)
    mask_truncated: bool = False  # overlong filtering: no loss on completions with no stop token
    normalize_advantages: bool = False  # rloo: whiten the leave-one-out advantages over the batch
    num_iterations: int = 1  # μ: updates per batch (ratio clipping matters when > 1)
    minibatch_size: int | None = None  # rows per optimizer step; None = the whole batch
    # multi-turn tool use (align/tools.py): up to this many <tool>EXPR</tool> calculator calls
    # per completion, results appended as <result>..</result> and masked out of the loss; 0 = off
    max_tool_calls: int = 0
    tool_cpu_seconds: int = 1  # sandbox limits per call: CPU seconds, address space, wall clock
    tool_memory_mb: int = 512
    tool_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("scale", self.scale, ADVANTAGE_SCALES)
        if self.group_size < 2:
            raise ConfigError("GRPO needs group_size >= 2 (advantages are relative to the group)")
        require_positive_ints(self, "num_iterations")
        if self.beta < 0 or self.clip_eps <= 0:
            raise ConfigError(f"need beta >= 0 and clip_eps > 0, got {self.beta}, {self.clip_eps}")
        require_choice("loss_type", self.loss_type, (*GRPO_LOSS_TYPES, "rloo"))
        if self.max_tool_calls < 0 or self.tool_cpu_seconds < 1 or self.tool_memory_mb < 64:
            raise ConfigError("need max_tool_calls >= 0, tool_cpu_seconds >= 1 and "
                              f"tool_memory_mb >= 64, got {self.max_tool_calls}, "
                              f"{self.tool_cpu_seconds}, {self.tool_memory_mb}")  # fmt: skip
        if self.clip_eps_high is not None and self.clip_eps_high <= 0:
            raise ConfigError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")


class GRPOTrainer(RLTrainer):
    """Group-relative policy optimisation against a verifier (or any reward)."""

    name = "grpo"
    fsdp_own_loop = True  # losses through optimizer_step, rollouts from whole copies
    curves = [("train", "reward"), ("eval", "exact_match"), ("train", "loss"), ("train", "kl")]

    def __init__(self, cfg: GRPOConfig, resume: bool = False, log=print, reward=None):
        self.needs_reference = cfg.beta > 0
        # RLOO charges Σ(log π_old - log π_ref) to the reward, so it needs π_old at rollout time
        self.keep_logprobs = cfg.num_iterations > 1 or (cfg.loss_type == "rloo" and cfg.beta > 0)
        super().__init__(cfg, resume=resume, log=log, reward=reward)

    def setup(self) -> None:
        super().setup()
        cfg: GRPOConfig = self.cfg
        if cfg.max_tool_calls > 0:  # the same engine, with calculator turns between model turns
            calculator = Calculator(cfg.tool_cpu_seconds, cfg.tool_memory_mb, cfg.tool_timeout_s)
            self.engine = ToolRolloutEngine(
                self.lm.model, self.tokenizer, cfg.max_new_tokens, cfg.temperature,
                reference=self.reference, max_tool_calls=cfg.max_tool_calls,
                calculator=calculator,
            )  # fmt: skip
            self.reward = ToolReward(self.reward)  # a failed tool call scores 0

    def update(self, rollout: Rollout) -> dict[str, float]:
        cfg: GRPOConfig = self.cfg
        self.prepare(rollout)
        # PPO-ptx: + replay_coef x next-token loss on pretraining text (align/replay.py)
        stats = self.minibatch_steps(
            rollout, cfg.num_iterations, cfg.minibatch_size or len(rollout),
            lambda mb: self.with_replay(*self.minibatch_loss(mb)), ("loss", "kl", "clip_frac"),
        )  # fmt: skip
        flat = (rollout.rewards.view(-1, cfg.group_size).std(-1) == 0).float().mean().item()
        return {**stats, "frac_zero_std": flat}

    def prepare(self, rollout: Rollout) -> None:
        """Overlong filtering (if asked) and the advantages, in place, before the updates."""
        cfg: GRPOConfig = self.cfg
        if cfg.mask_truncated:
            rollout.completion_mask = mask_truncated(
                rollout.completion_ids, rollout.completion_mask, self.engine.stop_ids
            )
        # dapo: every minibatch divides by its share of the rollout's real tokens, so the
        # minibatches of one rollout add up to its token mean (TRL's num_items_in_batch)
        self._tokens_per_row = rollout.completion_mask.sum().item() / len(rollout)
        if cfg.loss_type == "rloo":
            kl = None
            if cfg.beta > 0:
                k1 = kl_per_token(rollout.old_logprobs, rollout.ref_logprobs, "k1")
                kl = (k1 * rollout.completion_mask).sum(-1)
            rollout.advantages = rloo_advantages(
                rollout.rewards, cfg.group_size, cfg.normalize_advantages, kl, cfg.beta
            )
        else:
            rollout.advantages = group_advantages(rollout.rewards, cfg.group_size, cfg.scale)

    def minibatch_loss(self, mb: Rollout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The GRPO loss of one minibatch of a scored rollout (and its kl / clip_frac)."""
        cfg: GRPOConfig = self.cfg
        logp = completion_logprobs(
            self.lm.model, mb.input_ids, mb.attention_mask, mb.prompt_width, cfg.temperature
        )
        if cfg.loss_type == "rloo":
            loss, stats = rloo_loss(
                logp, mb.old_logprobs, mb.advantages, mb.completion_mask, cfg.clip_eps,
                cfg.clip_eps_high,
            )  # fmt: skip
            return loss, {**stats, "kl": torch.zeros(())}
        return grpo_loss(
            logp, mb.old_logprobs, mb.ref_logprobs, mb.advantages, mb.completion_mask,
            cfg.clip_eps, cfg.beta, cfg.loss_type, cfg.clip_eps_high, cfg.max_new_tokens,
            self._tokens_per_row * len(mb), cfg.kl_correction,
        )  # fmt: skip
