"""Rollouts for RL post-training: sample completions with the engine, then score them.

Every RL trainer (PPO, GRPO, RSFT) needs the same thing each step: G completions per prompt from
the current policy, their log-probs under the policy (π_old) and the frozen reference, optionally
a value per token, and one scalar reward per completion. `RolloutEngine.sample` produces that as
padded tensors in one layout, so the trainers only do their own maths:

    input_ids [B, P+C] = left-padded prompt (width P) | completion, right-padded (width C)
    completion_mask [B, C] = 1 on generated tokens (the stop token included), 0 on padding

Positions count from each row's first real token, exactly as during generation, so a re-scored
log-prob equals the one the sampler used. Per-token tensors (log-probs, values) are [B, C],
aligned with the completion tokens: only the C positions that predict them go through the LM head.

Rewards are pluggable: `VerifierReward` wraps any Python function of (record, completion) —
`tasks.verify` is one — and `ModelReward` any reward model callable on (input_ids,
attention_mask) -> [B]. A reward that raises or is not finite stops the run with a `RewardError`
naming the sample.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lmforge.align.logprobs import IGNORE, TokenStats, head_token_stats, lm_head_fn
from lmforge.data.batches import pad_collate
from lmforge.errors import ConfigError, LMForgeError
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.model.modes import eval_mode


class RewardError(LMForgeError):
    """A reward function raised or returned a non-finite value; the message shows the sample."""


def _clip(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


# ----------------------------------------------------------------------------- scoring passes


def completion_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, start: int
) -> Tensor:
    """Final-normed hidden states [B, C, d] at the positions predicting ``input_ids[:, start:]``."""
    h = model.hidden_states(input_ids, attention_mask)
    return model.norm(h[:, start - 1 : -1])


def completion_logits(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, start: int, temperature=1.0
) -> tuple[Tensor, Tensor]:
    """(logits [B, C, V], hidden states [B, C, d]) that score ``input_ids[:, start:]``, divided
    by the sampling temperature. Builds the whole [B, C, V] tensor: the trainers go through
    `completion_stats` instead; this is for inspecting a few positions."""
    h = completion_hidden(model, input_ids, attention_mask, start)
    return lm_head_fn(model, temperature)(h), h


def completion_stats(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    start: int,
    temperature=1.0,
    labels: Tensor | None = None,
    entropy: bool = False,
) -> tuple[TokenStats, Tensor]:
    """(`TokenStats` [B, C] of the completion tokens ``input_ids[:, start:]``, final-normed
    hidden states [B, C, d]) with the LM head applied a chunk of tokens at a time
    (logprobs.head_token_stats), so the [B, C, V] logits are never built.

    Logits are divided by the sampling temperature, so log-probs are those of the distribution
    the tokens were actually drawn from (TRL does the same). `labels` [B, C] default to the
    completion tokens with padding ignored."""
    h = completion_hidden(model, input_ids, attention_mask, start)
    if labels is None:
        labels = input_ids[:, start:].masked_fill(attention_mask[:, start:] == 0, IGNORE)
    return head_token_stats(lm_head_fn(model, temperature), h, labels, entropy=entropy), h


def completion_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, start: int, temperature=1.0
) -> Tensor:
    """log π(token) for every completion token → [B, C] (0 where the completion is padding)."""
    return completion_stats(model, input_ids, attention_mask, start, temperature)[0].logp


class ValueHead(nn.Module):
    """A scalar head V(s_t) on the policy's final-normed hidden states (the PPO critic)."""

    def __init__(self, d_model: int):
        super().__init__()
        self.proj = nn.Linear(d_model, 1)
        nn.init.zeros_(self.proj.weight)  # start predicting 0, like a fresh baseline
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.proj(hidden.float()).squeeze(-1)


# ----------------------------------------------------------------------------- rollouts


@dataclass
class Rollout:
    """A batch of sampled completions and what the trainers need to learn from them."""

    input_ids: Tensor  # [B, P+C]
    attention_mask: Tensor  # [B, P+C]
    completion_mask: Tensor  # [B, C] float
    prompt_width: int  # P
    group: Tensor  # [B] index of the prompt each row was sampled for
    records: list[dict] = field(default_factory=list)  # the prompt record of every row
    completions: list[str] = field(default_factory=list)
    rewards: Tensor | None = None  # [B]
    old_logprobs: Tensor | None = None  # [B, C]
    ref_logprobs: Tensor | None = None  # [B, C]
    values: Tensor | None = None  # [B, C]
    advantages: Tensor | None = None  # [B] or [B, C], filled in by the trainer
    returns: Tensor | None = None  # [B, C] value targets (PPO)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompts(self) -> list[str]:
        return [str(r.get("prompt", "")) for r in self.records]

    @property
    def completion_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_width :]

    @property
    def lengths(self) -> Tensor:
        """Completion lengths in tokens, [B]."""
        return self.completion_mask.sum(-1)

    def select(self, index: Tensor | Sequence[int]) -> Rollout:
        """The rows in ``index`` (a minibatch), tensors and lists alike."""
        index = torch.as_tensor(index, dtype=torch.long)
        changes: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                changes[f.name] = value[index.to(value.device)]
            elif isinstance(value, list) and value:
                changes[f.name] = [value[i] for i in index.tolist()]
        return replace(self, **changes)

    def minibatches(self, size: int, generator: torch.Generator | None = None) -> Iterator[Rollout]:
        """Shuffled minibatches of ``size`` rows covering the batch once (an epoch)."""
        order = torch.randperm(len(self), generator=generator)
        for i in range(0, len(self), size):
            yield self.select(order[i : i + size])


class RolloutEngine:
    """Samples G completions per prompt from a policy with the KV cache and scores them.

    ``reference`` (a frozen model) adds ref log-probs; ``value_fn(hidden, rollout) -> [B, C]``
    (a critic, given the policy's completion hidden states) adds values; ``keep_logprobs`` adds
    π_old log-probs (GRPO skips them when it makes one update per batch, where π_old = π).
    """

    def __init__(
        self,
        policy: nn.Module,
        tokenizer,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        reference: nn.Module | None = None,
        value_fn: Callable[[Tensor, Rollout], Tensor] | None = None,
    ):
        if temperature <= 0:
            raise ConfigError(f"RL sampling needs temperature > 0, got {temperature}")
        self.policy, self.tokenizer = policy, tokenizer
        self.reference, self.value_fn = reference, value_fn
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.stop_ids = list(stop_ids) if stop_ids is not None else default_stop_ids(tokenizer)
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    @torch.no_grad()
    def sample(
        self,
        prompt_ids: Sequence[Sequence[int]],
        records: Sequence[dict] | None = None,
        n: int = 1,
        seed: int | None = None,
        keep_logprobs: bool = True,
        greedy: bool = False,
    ) -> Rollout:
        """n completions for each prompt (consecutive rows), with log-probs/values as configured.

        ``records`` (one dict per prompt, e.g. {"prompt", "answer"}) travel with the rows for the
        reward function. ``greedy`` decodes with temperature 0 and skips the scoring passes (for
        evaluation).
        """
        prompts = [[int(t) for t in p] for p in prompt_ids]
        new = self.generate(prompts, n, seed, greedy)
        ids, mask = pad_collate([p for p in prompts for _ in range(n)], self.pad_id, side="left")
        comp, comp_mask = pad_collate(new, self.pad_id)
        if comp.shape[1] == 0:  # every completion empty: keep one padding column
            comp, comp_mask = F.pad(comp, (0, 1), value=self.pad_id), F.pad(comp_mask, (0, 1))
        if records is None:
            records = [{"prompt": self.tokenizer.decode(p)} for p in prompts]
        rollout = Rollout(
            input_ids=torch.cat([ids, comp], 1).to(self.device),
            attention_mask=torch.cat([mask, comp_mask], 1).to(self.device),
            completion_mask=comp_mask.float().to(self.device),
            prompt_width=ids.shape[1],
            group=torch.arange(len(prompts)).repeat_interleave(n),
            records=[r for r in records for _ in range(n)],
            completions=self.tokenizer.decode_batch(new, skip_special_tokens=True),
        )
        rollout = self.finish(rollout)
        if not greedy:
            self.annotate(rollout, keep_logprobs)
        return rollout

    def finish(self, rollout: Rollout) -> Rollout:
        """The sampled rollout before scoring; a subclass adds what its `generate` recorded."""
        return rollout

    def generate(
        self, prompts: list[list[int]], n: int, seed: int | None, greedy: bool = False,
        max_new_tokens: int | None = None, stop: Sequence[str] = (),
    ) -> list[list[int]]:  # fmt: skip
        """The completion tokens of n samples per prompt (consecutive), on the engine: one
        batch, each group's prompt prefilled once and its keys copied to the group's rows.
        Each stops at a stop token, after one of the `stop` strings, or after max_new_tokens."""
        budget = max_new_tokens or self.max_new_tokens
        params = GenerationParams(budget, 0.0 if greedy else self.temperature, seed=seed,
                                  stop=list(stop), stop_token_ids=self.stop_ids)  # fmt: skip
        max_len = min(self.policy.config.max_seq_len, max(map(len, prompts)) + budget)
        with eval_mode(self.policy):
            engine = Engine(self.policy, max_batch=len(prompts) * n, max_len=max_len,
                            eos_ids=self.stop_ids)  # fmt: skip
            return [c.token_ids for c in engine.generate(prompts, params, n)]

    @torch.no_grad()
    def annotate(self, rollout: Rollout, keep_logprobs: bool = True) -> None:
        """Fill in π_old / π_ref log-probs and values (no gradients; models in eval mode)."""
        args = (rollout.input_ids, rollout.attention_mask, rollout.prompt_width, self.temperature)
        labels = rollout.completion_ids.masked_fill(rollout.completion_mask == 0, IGNORE)
        if keep_logprobs or self.value_fn is not None:
            with eval_mode(self.policy):
                stats, hidden = completion_stats(self.policy, *args, labels=labels)
            if keep_logprobs:
                rollout.old_logprobs = stats.logp
            if self.value_fn is not None:
                rollout.values = self.value_fn(hidden, rollout) * rollout.completion_mask
        if self.reference is not None:
            rollout.ref_logprobs = completion_logprobs(self.reference, *args)


def default_stop_ids(tokenizer) -> list[int]:
    """EOS and the chat end-of-turn token, whichever the tokenizer has."""
    ids = [tokenizer.eos_id, tokenizer.token_to_id("<|end|>")]
    return sorted({i for i in ids if i is not None})


# ----------------------------------------------------------------------------- rewards


class VerifierReward:
    """A Python function ``fn(record, completion) -> float`` (bools count as 0/1) applied to every
    sample: exact-answer checkers such as ``tasks.verify``, unit tests, format rules."""

    def __init__(self, fn: Callable[[dict, str], float], name: str | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "reward function")

    def __call__(self, rollout: Rollout) -> Tensor:
        scores = []
        for i, (record, completion) in enumerate(zip(rollout.records, rollout.completions)):
            try:
                scores.append(float(self.fn(record, completion)))
            except Exception as err:
                raise RewardError(
                    f"{self.name} raised {type(err).__name__}: {err} on sample {i} "
                    f"(prompt {_clip(str(record.get('prompt')))}, completion {_clip(completion)})"
                ) from err
        out = torch.tensor(scores, dtype=torch.float32)
        check_finite(out, rollout, self.name)
        return out.to(rollout.input_ids.device)


class ModelReward:
    """A trained reward model: any callable on (input_ids, attention_mask) returning [B] scores
    (lmforge's RewardModel, or a wrapped Hugging Face classifier). Kept frozen, in eval mode."""

    def __init__(self, model: Callable[[Tensor, Tensor], Tensor], batch_size: int = 64):
        self.model, self.batch_size = model, batch_size
        self.name = type(model).__name__
        if isinstance(model, nn.Module):
            model.eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, rollout: Rollout) -> Tensor:
        chunks = []
        for i in range(0, len(rollout), self.batch_size):
            ids = rollout.input_ids[i : i + self.batch_size]
            mask = rollout.attention_mask[i : i + self.batch_size]
            try:
                chunks.append(torch.as_tensor(self.model(ids, mask)).float().reshape(-1))
            except Exception as err:
                raise RewardError(
                    f"reward model {self.name} raised {type(err).__name__}: {err} on samples "
                    f"{i}..{i + len(ids) - 1} (first prompt {_clip(rollout.prompts[i])})"
                ) from err
        out = torch.cat(chunks)
        if out.numel() != len(rollout):
            raise RewardError(
                f"reward model {self.name} returned {out.numel()} scores for {len(rollout)} samples"
            )
        check_finite(out, rollout, f"reward model {self.name}")
        return out


def check_finite(scores: Tensor, rollout: Rollout, name: str) -> None:
    """Raise RewardError naming the first sample whose reward is NaN or infinite."""
    if bad := (~torch.isfinite(scores)).nonzero().flatten().tolist():
        i = bad[0]
        prompt = rollout.prompts[i] if rollout.records else "?"
        completion = rollout.completions[i] if rollout.completions else "?"
        raise RewardError(
            f"{name} returned {scores[i].item()} for sample {i} of {len(rollout)} "
            f"({len(bad)} non-finite in all): prompt {_clip(prompt)}, "
            f"completion {_clip(completion)}"
        )


def rollout_stats(rollout: Rollout) -> dict[str, float]:
    """Mean reward / reward std / mean completion length, for logs."""
    stats = {"length": rollout.lengths.float().mean().item()}
    if rollout.rewards is not None:
        stats["reward"] = rollout.rewards.float().mean().item()
        # rewards are checked finite where they are made (VerifierReward, ModelReward)
        stats["reward_std"] = rollout.rewards.float().std().item() if len(rollout) > 1 else 0.0
    return stats
