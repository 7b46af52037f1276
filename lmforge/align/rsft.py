"""Rejection-sampling fine-tuning (RAFT / best-of-N / expert iteration).

Each round samples N completions (`group_size`) for `batch_size` prompts, scores them with a
frozen reward (a verifier or a reward model), keeps some per prompt, and fine-tunes on the kept
(prompt, completion) pairs with the SFT loss (response tokens only, `logprobs.lm_sft_loss`) for
`sft_epochs` passes. `max_iters` is the number of rounds; the mean reward of each round's samples
is the curve that should rise.

Selection rules, picked by `select`:
  best       the highest-scoring completion of each prompt (best-of-N, RAFT)
  top_k      the `top_k` highest-scoring completions of each prompt
  boltzmann  `top_k` draws per prompt, with replacement, ∝ exp(R/τ) (soft best-of-N)
`min_reward` drops kept samples scoring below it (with a 0/1 verifier, 1.0 keeps correct ones).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lmforge.align.logprobs import IGNORE, lm_sft_loss
from lmforge.align.rl import RLConfig, RLTrainer
from lmforge.align.rollout import Rollout
from lmforge.errors import ConfigError, require_choice, require_positive_ints
from lmforge.train.config import run_config

SELECTORS = ("best", "top_k", "boltzmann")  # the selection rules of the module docstring


def select_rows(
    rewards: Tensor, group_size: int, rule: str, k: int = 1, tau: float = 1.0,
    min_reward: float | None = None, gen: torch.Generator | None = None,
) -> Tensor:  # fmt: skip
    """Flat row indices of the kept completions (consecutive groups of ``group_size``)."""
    require_choice("select", rule, SELECTORS)
    grouped = rewards.view(-1, group_size)
    if rule == "best":
        within = grouped.argmax(-1, keepdim=True)
    elif rule == "top_k":
        within = grouped.topk(min(k, group_size), dim=-1).indices
    else:  # boltzmann: k draws per group with replacement, P(i) ∝ exp(R_i/τ)
        probs = torch.softmax(grouped.float().cpu() / tau, dim=-1)
        draws = torch.multinomial(probs, k, replacement=True, generator=gen or torch.Generator())
        within = draws.to(rewards.device)
    rows = within + torch.arange(grouped.shape[0], device=within.device)[:, None] * group_size
    rows = rows.flatten()
    if min_reward is not None:
        rows = rows[rewards[rows] >= min_reward]
    return rows


@run_config(optim=dict(max_iters=5, eval_interval=1, lr=3e-4, min_lr=3e-4))
class RSFTConfig(RLConfig):
    """An RSFT run (`lmforge rsft`); ``max_iters`` counts rounds."""

    out_dir: str = "out/rsft"
    group_size: int = 8  # N samples per prompt
    select: str = "best"  # best | top_k | boltzmann
    top_k: int = 2  # kept per prompt for top_k / draws for boltzmann
    tau: float = 0.1  # boltzmann temperature on rewards
    min_reward: float | None = None  # drop kept samples below this reward
    sft_epochs: int = 2
    minibatch_size: int = 32
    batch_size: int = 128  # prompts per round

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("select", self.select, SELECTORS)
        require_positive_ints(self, "top_k", "sft_epochs", "minibatch_size")
        if self.tau <= 0:
            raise ConfigError(f"tau must be > 0, got {self.tau}")


class RSFTTrainer(RLTrainer):
    """Sample, score, keep the best, fine-tune on them; repeat."""

    name = "rsft"
    curves = [("train", "reward"), ("eval", "reward"), ("train", "loss"), ("train", "kept")]
    needs_reference = False
    keep_logprobs = False

    def kept_loss(self, mb: Rollout) -> tuple[Tensor, dict[str, float]]:
        """The SFT loss of a minibatch of kept samples: on their completion tokens only."""
        labels = mb.input_ids.masked_fill(mb.attention_mask == 0, IGNORE)
        labels[:, : mb.prompt_width] = IGNORE
        return lm_sft_loss(self.lm.model, mb.input_ids, labels, mb.attention_mask), {}

    def update(self, rollout: Rollout) -> dict[str, float]:
        cfg: RSFTConfig = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed + self.step)
        rows = select_rows(
            rollout.rewards, cfg.group_size, cfg.select, cfg.top_k, cfg.tau, cfg.min_reward, gen
        )
        if rows.numel() == 0:
            return {"loss": 0.0, "kept": 0.0, "kept_reward": 0.0}
        kept = rollout.select(rows.cpu())
        stats = self.minibatch_steps(kept, cfg.sft_epochs, cfg.minibatch_size, self.kept_loss,
                                     ("loss",), gen)  # fmt: skip
        return {**stats, "kept": float(len(kept)), "kept_reward": kept.rewards.mean().item()}
