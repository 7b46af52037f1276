"""Switching a model's training flag for a while (generation, evaluation) and back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


@contextmanager
def eval_mode(*models: nn.Module | None) -> Iterator[None]:
    """Models in eval mode for a generation or an evaluation; their training flags are restored
    afterwards (an RL policy or a model being fine-tuned goes on training). None entries are
    skipped."""
    flags = [(m, m.training) for m in models if m is not None]
    for m, _ in flags:
        m.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.train(training)
