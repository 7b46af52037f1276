import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.errors import LMForgeError
from lmforge.nlp import metrics as M


def test_precision_recall_f1_from_counts():
    p, r, f1 = M.precision_recall_f1(tp=8, fp=2, fn=4)
    assert p == pytest.approx(0.8)
    assert r == pytest.approx(2 / 3)
    assert f1 == pytest.approx(2 * p * r / (p + r)) == pytest.approx(8 / 11)
    assert M.precision_recall_f1(0, 0, 0) == (0.0, 0.0, 0.0)
    with pytest.raises(LMForgeError, match="fp must be >= 0"):
        M.precision_recall_f1(1, -1, 0)


def test_precision_recall_f1_from_labels():
    y_true = [1, 1, 0, 1, 0, 0, 1]
    y_pred = [1, 0, 0, 1, 1, 0, 1]
    assert M.precision_recall_f1_from_labels(y_true, y_pred) == pytest.approx((0.75, 0.75, 0.75))
    # class 0: TP 2, FP 1, FN 1 -> 2/3 each; macro averages it with class 1's 0.75.
    macro = M.precision_recall_f1_from_labels(y_true, y_pred, average="macro")
    assert macro == pytest.approx(((0.75 + 2 / 3) / 2,) * 3)
    micro = M.precision_recall_f1_from_labels(y_true, y_pred, average="micro")
    assert micro == pytest.approx((5 / 7,) * 3)
    with pytest.raises(LMForgeError, match="differ in length"):
        M.precision_recall_f1_from_labels([1], [1, 0])
    with pytest.raises(LMForgeError, match="average"):
        M.precision_recall_f1_from_labels([1], [1], average="weighted")


def test_perplexity_from_nll():
    # Three bits of entropy is a choice among 2**3 = 8 equally likely symbols.
    assert M.perplexity_from_nll(3.0, base=2) == pytest.approx(8.0)
    assert M.perplexity_from_nll([math.log(2), math.log(4)]) == pytest.approx(2**1.5)
    with pytest.raises(LMForgeError, match="no token"):
        M.perplexity_from_nll([])


def test_entropy_kl_cross_entropy_known_values():
    assert M.entropy([1 / 8] * 8, base=2) == pytest.approx(3.0)
    assert M.entropy([1.0, 0.0]) == 0.0
    p, q = [0.5, 0.5], [0.25, 0.75]
    kl = 0.5 * math.log2(2) + 0.5 * math.log2(0.5 / 0.75)
    assert M.kl_divergence(p, q, base=2) == pytest.approx(kl)
    assert M.cross_entropy(p, q, base=2) == pytest.approx(1.0 + kl)
    assert M.kl_divergence([1.0, 0.0], [0.0, 1.0]) == math.inf
    assert M.cross_entropy([1.0, 0.0], [0.0, 1.0]) == math.inf


def _dist(values):
    a = np.asarray(values) + 1e-3
    return (a / a.sum()).tolist()


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda n: st.tuples(
            st.lists(st.floats(0, 1), min_size=n, max_size=n),
            st.lists(st.floats(0, 1), min_size=n, max_size=n),
        )
    ),
    st.sampled_from([2.0, math.e, 10.0]),
)
def test_cross_entropy_is_entropy_plus_kl(pq, base):
    p, q = _dist(pq[0]), _dist(pq[1])
    h = M.cross_entropy(p, q, base=base)
    assert h == pytest.approx(M.entropy(p, base=base) + M.kl_divergence(p, q, base=base), abs=1e-9)
    assert M.kl_divergence(p, q, base=base) >= -1e-12


def test_distribution_validation():
    with pytest.raises(LMForgeError, match="sum to 1"):
        M.entropy([0.5, 0.6])
    with pytest.raises(LMForgeError, match="negative"):
        M.entropy([1.5, -0.5])
    with pytest.raises(LMForgeError, match="differ in size"):
        M.kl_divergence([1.0], [0.5, 0.5])


def test_label_smoothing_distribution():
    q = M.label_smoothing(2, 4, 0.1)
    assert q == pytest.approx([0.025, 0.025, 0.925, 0.025])
    assert q.sum() == pytest.approx(1.0)
    with pytest.raises(LMForgeError, match="outside"):
        M.label_smoothing(4, 4, 0.1)
    with pytest.raises(LMForgeError, match="epsilon"):
        M.label_smoothing(0, 4, 1.5)


def test_label_smoothed_loss_matches_torch():
    logits = np.array([[2.0, -1.0, 0.5, 0.0], [0.1, 0.2, 3.0, -2.0], [100.0, 0.0, 0.0, 0.0]])
    targets = [0, 3, 1]
    ref = torch.nn.functional.cross_entropy(
        torch.tensor(logits), torch.tensor(targets), label_smoothing=0.1
    )
    assert M.label_smoothed_loss(logits, targets, 0.1) == pytest.approx(ref.item(), rel=1e-9)
    single = torch.nn.functional.cross_entropy(
        torch.tensor(logits[:1]), torch.tensor([0]), label_smoothing=0.2
    )
    assert M.label_smoothed_loss(logits[0], 0, 0.2) == pytest.approx(single.item(), rel=1e-9)
    with pytest.raises(LMForgeError, match="do not match"):
        M.label_smoothed_loss(logits, [0, 1], 0.1)
