"""The honest protocol's statistics (benchmarks/protocol.py): the paired bootstrap interval
against scipy.stats.bootstrap as the oracle, and the held-out check."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from protocol import check_held_out, paired_bootstrap  # noqa: E402

scipy_stats = pytest.importorskip("scipy.stats")


def scipy_interval(a, b, n_resamples, confidence, seed):
    """scipy's paired percentile bootstrap of mean(a) - mean(b)."""
    result = scipy_stats.bootstrap(
        (a, b), lambda x, y, axis=-1: x.mean(axis) - y.mean(axis), paired=True, vectorized=True,
        n_resamples=n_resamples, confidence_level=confidence, method="percentile",
        rng=np.random.default_rng(seed),
    )  # fmt: skip
    return result.confidence_interval


@pytest.mark.parametrize(
    "n, confidence, seed, kind",
    [
        (150, 0.95, 0, "binary"),
        (37, 0.9, 3, "binary"),
        (200, 0.95, 11, "real"),
        (2, 0.95, 5, "real"),
    ],
)
def test_paired_bootstrap_equals_scipy(n, confidence, seed, kind):
    rng = np.random.default_rng(100 + n)
    if kind == "binary":  # per-example pass/fail of two models, correlated as on one test set
        a = (rng.random(n) < 0.4).astype(float)
        b = np.where(rng.random(n) < 0.7, a, (rng.random(n) < 0.3).astype(float))
    else:
        a, b = rng.normal(0.3, 1.0, n), rng.normal(0.0, 1.0, n)
    ours = paired_bootstrap(a.tolist(), b.tolist(), n_resamples=4000, confidence=confidence,
                            seed=seed)  # fmt: skip
    low, high = scipy_interval(a, b, 4000, confidence, seed)
    assert ours.diff == pytest.approx(a.mean() - b.mean(), abs=1e-12)
    assert ours.low == pytest.approx(low, abs=1e-12)
    assert ours.high == pytest.approx(high, abs=1e-12)
    assert ours.low <= ours.high and ours.n == n and ours.confidence == confidence


@pytest.mark.parametrize("n, seed", [(64, 0), (9, 4)])
def test_win_rate_interval_equals_scipy_one_sample(n, seed):
    """A win rate against 0.5 (benchmarks/recipes.py: paired_bootstrap(wins, [0.5] * n)) is the
    one-sample percentile bootstrap of the mean win, shifted by 0.5."""
    wins = np.random.default_rng(n).choice([0.0, 0.5, 1.0], size=n, p=[0.4, 0.1, 0.5])
    ours = paired_bootstrap(wins.tolist(), [0.5] * n, n_resamples=4000, seed=seed)
    low, high = scipy_stats.bootstrap(
        (wins,), lambda x, axis=-1: x.mean(axis), vectorized=True, n_resamples=4000,
        confidence_level=0.95, method="percentile", rng=np.random.default_rng(seed),
    ).confidence_interval  # fmt: skip
    assert ours.diff + 0.5 == pytest.approx(wins.mean(), abs=1e-12)
    assert ours.low + 0.5 == pytest.approx(low, abs=1e-12)
    assert ours.high + 0.5 == pytest.approx(high, abs=1e-12)


def test_paired_bootstrap_is_seeded_and_pairs_examples():
    a = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert paired_bootstrap(a, a, seed=1) == paired_bootstrap(a, a, seed=1)
    same = paired_bootstrap(a, a)  # paired: identical models differ by exactly 0 in every resample
    assert (same.diff, same.low, same.high) == (0.0, 0.0, 0.0)
    shifted = paired_bootstrap([x + 0.25 for x in a], a)
    assert shifted.low == pytest.approx(0.25) and shifted.high == pytest.approx(0.25)


def test_paired_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([1.0], [0.0])
    with pytest.raises(ValueError, match="confidence"):
        paired_bootstrap([1.0, 0.0], [0.0, 1.0], confidence=1.0)


def test_check_held_out():
    check_held_out(["q1", "q2"], train=["q3"], validation=["q4"])
    with pytest.raises(SystemExit, match="1 test prompt.*validation"):
        check_held_out(["q1", "q2"], train=["q3"], validation=["q2"])
