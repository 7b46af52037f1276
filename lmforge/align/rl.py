"""What PPO, GRPO and RSFT share: a prompt set, a reward, a rollout engine, and the shared loop
(lmforge/train/loop.py) with one rollout per step.

A step's batch is a rollout (`next_batch`): sample `batch_size` prompts, draw `group_size`
completions each with the KV-cache engine, score them. The subclass's `update(rollout)` then
learns from it through the loop's shared `optimizer_step` (one per minibatch, as often as it
likes): the loss runs inside the DDP/FSDP-wrapped call, so gradients are reduced there, and the
NaN guard, clipping and the optimizer step are the loop's. Evaluation decodes the held-out
prompts greedily and reports the mean reward and, when the records carry answers, exact-match
accuracy.

The reward is `reward: verifier` (`tasks.verify`, exact answer match) or the path of a trained
reward-model directory; in Python any function of (record, completion) or reward model works.
"""

from __future__ import annotations

from abc import abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.align import data as D
from lmforge.align.rollout import (
    ModelReward,
    Rollout,
    RolloutEngine,
    VerifierReward,
    rollout_stats,
)
from lmforge.align.trainer import AlignConfig, AlignTrainer, frozen_copy, split_dataset
from lmforge.errors import ConfigError, DataError, require_positive_ints
from lmforge.peft.config import PeftConfig, apply_peft
from lmforge.tasks.answers import verify
from lmforge.train.config import run_config, section
from lmforge.train.whole_copy import LoopWrapsLoss


@run_config(optim=dict(lr=1e-4, min_lr=1e-5, warmup_iters=0, eval_interval=20, log_interval=1))
class RLConfig(AlignConfig):
    """Fields every RL trainer shares (on top of AlignConfig's data/optimizer/loop fields).

    ``batch_size`` is prompts per step and ``max_iters`` the number of rollout steps.
    """

    peft: PeftConfig = section(PeftConfig)
    data: str = "task:add:2"  # prompt records: JSONL ({"prompt", "answer"}, GSM8K) or task:NAME
    reward: str = "verifier"  # verifier (tasks.verify) | path to a reward-model directory
    group_size: int = 1  # completions sampled per prompt
    max_new_tokens: int = 8
    temperature: float = 1.0
    batch_size: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_ints(self, "group_size")
        if self.optim.grad_accum != 1:
            raise ConfigError(
                "grad_accum must be 1 for RL trainers (minibatch_size splits a rollout)"
            )
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0 for RL sampling, got {self.temperature}")


def load_reward(spec: Any, tokenizer, device) -> Any:
    """The reward of a run: a Python one as is (an nn.Module as a ModelReward, a function as a
    VerifierReward), or the config's string: `verifier` → tasks.verify, otherwise a
    reward-model directory (``lmforge reward``)."""
    if isinstance(spec, VerifierReward | ModelReward):
        return spec
    if isinstance(spec, nn.Module):
        return ModelReward(spec)
    if callable(spec):
        return VerifierReward(spec)
    if spec == "verifier":
        return VerifierReward(verify, name="tasks.verify")
    if not Path(str(spec)).is_dir():
        raise ConfigError(f"reward must be 'verifier' or a reward-model directory, got {spec!r}")
    from lmforge.align.reward import RewardModel

    model, rm_tokenizer = RewardModel.load(spec, device=device)
    if rm_tokenizer is None or rm_tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ConfigError(
            f"reward model {spec} uses a different tokenizer from the policy; train it from the "
            "same base (e.g. --init the SFT checkpoint) so it can score the policy's token ids"
        )
    return ModelReward(model)


class RLTrainer(AlignTrainer):
    """AlignTrainer with a rollout per step; subclasses implement `update(rollout)`."""

    name = "rl"
    curves = [("train", "reward"), ("eval", "reward"), ("eval", "exact_match")]
    needs_reference = True  # subclasses without a KL term skip the frozen copy
    keep_logprobs = True  # π_old log-probs at rollout time (off when updates are on-policy)
    value_fn = None  # the rollout engine's critic, value_fn(hidden, rollout) -> [B, C] (PPO's)

    def __init__(self, cfg: RLConfig, resume: bool = False, log=print, reward: Any = None):
        self._reward_override = reward  # a Python reward (function or model) instead of cfg
        # FSDP: every rank samples from its own whole copy; DDP: PPO's critic warm-up leaves
        # the policy out of some steps (no static graph)
        wrapping = LoopWrapsLoss(copy_on_every_rank=True, static_graph=False)
        super().__init__(cfg, resume=resume, log=log, wrapping=wrapping)
        self.dist.find_unused_parameters = True

    # ---- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg: RLConfig = self.cfg
        records = D.load_prompts(cfg.data, n=cfg.n_train, seed=cfg.seed, split="train")
        self.records, eval_records = split_dataset(
            records, cfg, lambda src, split: D.load_prompts(src, cfg.n_eval, cfg.seed + 1, split)
        )
        self.eval_records = eval_records[: cfg.n_eval]
        self.prompts = [self._encode(r, i) for i, r in enumerate(self.records)]
        self.eval_prompts = [self._encode(r, i) for i, r in enumerate(self.eval_records)]
        reward = cfg.reward if self._reward_override is None else self._reward_override
        self.reward = load_reward(reward, self.tokenizer, self.device)
        self.reference = frozen_copy(self.lm.model) if self.needs_reference else None
        self.peft_names = apply_peft(self.lm.model, cfg.peft)
        self.engine = RolloutEngine(
            self.lm.model,
            self.tokenizer,
            cfg.max_new_tokens,
            cfg.temperature,
            reference=self.reference,
            value_fn=self.value_fn,
        )

    def _encode(self, record: dict, i: int) -> list[int]:
        ids = D.prompt_ids(record, self.tokenizer, self.cfg.add_bos)
        limit = self.lm.config.max_seq_len - 1
        if not ids or len(ids) > limit:
            raise DataError(
                f"{self.cfg.data}: prompt record {i} has {len(ids)} tokens; it must have 1.."
                f"{limit} to leave room for a completion (max_seq_len={limit + 1})"
            )
        return ids

    def num_examples(self) -> int:
        return len(self.records)

    def loss(self, batch):
        raise ConfigError(f"{self.name} trains from rollouts; its update() names its losses")

    def loss_weight(self, batch) -> float:
        return 1.0  # every rank's minibatch has the same rows: their mean is the batch's

    # ---- one step ----------------------------------------------------------------------------
    def sample(self, *args, **kwargs) -> Rollout:
        """`self.engine.sample(...)` with whole weights. Collective under FSDP: every rank first
        joins one gather that refreshes its whole copy of the policy (once per step), then
        generates and scores alone, with no collective, so ranks whose completions differ in
        length never wait on each other."""
        with self.whole_weights():
            return self.engine.sample(*args, **kwargs)

    def rollout(self, indices: list[int]) -> Rollout:
        """Sample group_size completions for each prompt in ``indices`` and score them."""
        cfg: RLConfig = self.cfg
        rollout = self.sample(
            [self.prompts[i] for i in indices],
            [self.records[i] for i in indices],
            n=cfg.group_size,
            seed=cfg.seed * 100_003 + self.step + 7_919 * self.dist.rank,  # ranks: own samples
            keep_logprobs=self.keep_logprobs,
        )
        rollout.rewards = self.reward(rollout)
        return rollout

    @abstractmethod
    def update(self, rollout: Rollout) -> dict[str, float]:
        """Learn from one scored rollout through `optimizer_step`; return metrics to log."""

    def minibatch_steps(self, rollout: Rollout, epochs: int, size: int, loss_fn, keys,
                        gen: torch.Generator | None = None) -> dict[str, float]:  # fmt: skip
        """`epochs` passes over shuffled minibatches of `size` rows (order drawn from `gen`, by
        default seeded with the step), one `optimizer_step(loss_fn)` each; the mean of each of
        the losses' stats in `keys` and of the gradient norm before clipping."""
        gen = gen or torch.Generator().manual_seed(self.cfg.seed + self.step)
        steps = []
        for _ in range(epochs):
            steps += [self.optimizer_step([mb], loss_fn) for mb in rollout.minibatches(size, gen)]
        return {k: sum(s[k] for s in steps) / len(steps) for k in (*keys, "grad_norm")}

    def next_batch(self) -> Rollout:
        """The rollout phase: this rank's prompts of the step, sampled and scored."""
        return self.rollout(self.sampler.next())

    def learn(self, rollout: Rollout) -> dict[str, float]:
        # the rollout's statistics are this rank's: the mean over ranks is the batch's
        return self.dist.mean({**rollout_stats(rollout), **self.update(rollout)})

    # ---- evaluation and export ---------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Greedy completions of the held-out prompts: mean reward (and exact match if the
        records have answers)."""
        if not self.eval_prompts:
            return {}
        rewards, hits = [], []
        for i in range(0, len(self.eval_prompts), 128):
            records = self.eval_records[i : i + 128]
            rollout = self.engine.sample(
                self.eval_prompts[i : i + 128], records, keep_logprobs=False, greedy=True
            )
            rewards.append(self.reward(rollout))
            if all("answer" in r for r in records):
                hits += [verify(r, c) for r, c in zip(records, rollout.completions)]
        result = {"reward": torch.cat(rewards).mean().item()}
        if hits:
            result["exact_match"] = sum(hits) / len(hits)
        return result
