"""Turning logits into the next token: greedy, temperature, top-k, top-p (nucleus).

Filters work on a [B, V] logits tensor and return logits with excluded tokens at -inf, so they
compose in any order; sampling happens once at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.errors import ConfigError


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens}")
        if not 0 <= self.temperature < float("inf"):  # also refuses NaN, which compares False
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")


def softmax_with_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(z / tau): tau < 1 sharpens, tau > 1 flattens."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits per row, plus any tied with the k-th value."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose cumulative probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    # A token is dropped when the tokens before it already reach p (the first is always kept).
    before = probs.cumsum(-1) - probs
    drop_sorted = before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Next token ids [B] from last-position logits [B, V]."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
