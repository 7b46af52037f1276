"""The honest protocol's statistics and checks (issue 20), shared by the post-training benchmarks.

- `paired_bootstrap`: the 95% interval of the difference of two models' mean scores on the same
  test examples (resample examples with replacement, percentile interval; seeded). Checked
  against `scipy.stats.bootstrap(..., paired=True, method="percentile")` in
  tests/benchmarks/test_protocol.py, draw for draw.
- `check_held_out`: no test prompt among the prompts a run trained or chose on.

A claim "method X improves metric Y" is reported as after - baseline with its interval, where
the baseline is the starting model trained further with plain SFT for the same steps and
examples (benchmarks/recipes.py builds it from the recipe itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A difference of means and its bootstrap percentile interval."""

    diff: float
    low: float
    high: float
    confidence: float
    n: int

    def __str__(self) -> str:
        return f"{self.diff:+.4f} [{self.low:+.4f}, {self.high:+.4f}]"


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    n_resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Interval:
    """mean(a) - mean(b) over paired per-example scores (a[i], b[i] are one test example's scores
    under two models) and its percentile bootstrap interval: `n_resamples` resamples of the
    examples with replacement (one index draw shared by both models, as the pairing requires),
    the (1 - confidence)/2 and (1 + confidence)/2 quantiles of the resampled differences.

    The draws are numpy's default_rng(seed).integers(0, n, (n_resamples, n)), those of
    scipy.stats.bootstrap given the same generator, so the two agree exactly."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        raise ValueError(f"need two equal-length score lists of >= 2 examples, got {a.shape}, "
                         f"{b.shape}")  # fmt: skip
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    idx = np.random.default_rng(seed).integers(0, len(a), (n_resamples, len(a)))
    diffs = a[idx].mean(-1) - b[idx].mean(-1)
    alpha = (1 - confidence) / 2
    low, high = np.quantile(diffs, [alpha, 1 - alpha])
    return Interval(float(a.mean() - b.mean()), float(low), float(high), confidence, len(a))


def check_held_out(test: Iterable[str], **seen: Iterable[str]) -> None:
    """Raise if any test prompt is also among `seen` (e.g. train=..., validation=...): the test
    split is read only to report, never trained or chosen on."""
    test = set(test)
    for name, prompts in seen.items():
        shared = test & set(prompts)
        if shared:
            raise SystemExit(f"protocol: {len(shared)} test prompt(s) also in {name}, e.g. "
                             f"{next(iter(shared))[:80]!r}")  # fmt: skip
