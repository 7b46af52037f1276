"""What one request asks of the engine (GenerationParams, validated once on arrival) and what
it gets back (StepOutput as it goes, Completion at the end)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lmforge.errors import ConfigError

MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and of the most likely alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class TokenConstraint(Protocol):
    """One sample's grammar state (structured output, tool calls): which tokens may come next,
    and the token that did. The engine's sampler masks every other token out before it draws."""

    def allowed(self) -> torch.Tensor:
        """A bool tensor over the vocabulary (at least the model's logits wide): True = allowed."""
        ...

    def consume(self, token: int) -> None:
        """Advance past the sampled token."""
        ...


@dataclass
class GenerationParams:
    """How to generate for one request (the one parameter class of every generation path).
    temperature 0 = greedy; logprobs=k returns the chosen token's log-probability and the k
    most likely alternatives (None = off); seed: a seeded request with n samples gets the same
    tokens whatever else runs beside it; suppress_token_ids are never sampled; constraint: called
    once per sample for its TokenConstraint (e.g. a JSON schema's grammar, infer/structured.py)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None  # None = the engine's EOS ids; [] = never stop early
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    suppress_token_ids: list[int] = field(default_factory=list)
    constraint: Callable[[], TokenConstraint] | None = None

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        k = self.logprobs
        logprobs_ok = k is None or (_is_int(k) and 0 <= k <= MAX_TOP_LOGPROBS)
        checks = [
            (_is_int(self.max_new_tokens) and self.max_new_tokens >= 1, "max_new_tokens", ">= 1"),
            (0 <= self.temperature < float("inf"), "temperature", "a finite number >= 0"),
            (self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1), "top_k", ">= 1"),
            (self.top_p is None or 0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "> 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "in [-2, 2]"),
            (logprobs_ok, "logprobs", f"an integer in [0, {MAX_TOP_LOGPROBS}]"),
            (all(isinstance(s, str) for s in self.stop), "stop", "a list of strings"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ConfigError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def has_penalties(self) -> bool:
        penalties = (self.repetition_penalty, self.presence_penalty, self.frequency_penalty)
        return penalties != (1.0, 0.0, 0.0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class StepOutput:
    """What one sequence produced in one step: new token ids and the text they completed."""

    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    """A finished sequence (Engine.generate)."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
