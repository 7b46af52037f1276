"""Evaluation metrics from the classical NLP notes: precision/recall/F1, perplexity, entropy,
KL divergence, cross-entropy (H(P,Q) = H(P) + KL(P||Q)) and label smoothing.

Distributions are 1-D sequences of probabilities. `base` picks the logarithm: e (nats, default),
2 (bits) or 10.
"""

import math
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np

from lmforge.errors import LMForgeError


def precision_recall_f1(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
    """Precision TP/(TP+FP), recall TP/(TP+FN) and F1 = 2PR/(P+R) from counts.

    An undefined ratio (zero denominator) is reported as 0.0, as scikit-learn does by default.
    """
    for name, v in (("tp", tp), ("fp", fp), ("fn", fn)):
        if v < 0:
            raise LMForgeError(f"precision_recall_f1: {name} must be >= 0, got {v}")
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * p * r / (p + r) if p + r else 0.0
    return p, r, f1


def precision_recall_f1_from_labels(
    y_true: Sequence[Hashable],
    y_pred: Sequence[Hashable],
    *,
    positive: Hashable = 1,
    average: str = "binary",
) -> tuple[float, float, float]:
    """Precision, recall and F1 from gold and predicted labels.

    average="binary" scores the `positive` class only; "micro" pools TP/FP/FN over all classes;
    "macro" averages per-class P, R and F1 (each class's F1 from its own P and R).
    """
    if len(y_true) != len(y_pred):
        raise LMForgeError(f"y_true and y_pred differ in length ({len(y_true)} vs {len(y_pred)})")
    if average == "binary":
        return precision_recall_f1(*_counts(y_true, y_pred, positive))
    if average not in ("micro", "macro"):
        raise LMForgeError(f"average must be 'binary', 'micro' or 'macro', got {average!r}")
    classes = list(dict.fromkeys([*y_true, *y_pred]))
    if not classes:
        return 0.0, 0.0, 0.0
    counts = [_counts(y_true, y_pred, c) for c in classes]
    if average == "micro":
        return precision_recall_f1(*(sum(col) for col in zip(*counts)))
    per_class = [precision_recall_f1(*c) for c in counts]
    p, r, f1 = (sum(col) / len(per_class) for col in zip(*per_class))
    return p, r, f1


def _counts(y_true, y_pred, label) -> tuple[int, int, int]:
    """(TP, FP, FN) of `label`, from one count of (is gold, is predicted) pairs."""
    hits = Counter((t == label, p == label) for t, p in zip(y_true, y_pred))
    return hits[True, True], hits[False, True], hits[True, False]


def perplexity_from_nll(nll: float | Sequence[float], *, base: float = math.e) -> float:
    """Perplexity = base ** (mean negative log-likelihood per token).

    `nll` is either the mean NLL already (a float) or per-token NLLs; both in the same `base`
    (nats for e, bits for 2). A model with 3 bits of entropy has perplexity 2**3 = 8.
    """
    values = np.atleast_1d(np.asarray(nll, dtype=np.float64))
    if values.size == 0:
        raise LMForgeError("perplexity_from_nll: no token log-likelihoods given")
    return float(base ** values.mean())


def _as_distribution(p: Sequence[float], name: str) -> np.ndarray:
    arr = np.asarray(p, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise LMForgeError(
            f"{name} must be a non-empty 1-D probability vector, got shape {arr.shape}"
        )
    if (arr < 0).any() or not np.isfinite(arr).all():
        raise LMForgeError(f"{name} has negative or non-finite probabilities")
    if abs(arr.sum() - 1.0) > 1e-6:
        raise LMForgeError(f"{name} must sum to 1, sums to {arr.sum():.6g}")
    return arr


def entropy(p: Sequence[float], *, base: float = math.e) -> float:
    """Shannon entropy H(P) = -sum_x P(x) log P(x), with 0 log 0 = 0."""
    arr = _as_distribution(p, "p")
    nz = arr[arr > 0]
    return float(-(nz * np.log(nz)).sum() / math.log(base))


def _sum_on_support(p: Sequence[float], q: Sequence[float], term, base: float) -> float:
    """sum over x with P(x) > 0 of term(P(x), Q(x)), in log `base`; infinite when Q is 0 there."""
    pa, qa = _as_distribution(p, "p"), _as_distribution(q, "q")
    if pa.shape != qa.shape:
        raise LMForgeError(f"p and q differ in size ({pa.size} vs {qa.size})")
    support = pa > 0
    if (qa[support] == 0).any():
        return math.inf
    return float(term(pa[support], qa[support]).sum() / math.log(base))


def kl_divergence(p: Sequence[float], q: Sequence[float], *, base: float = math.e) -> float:
    """KL(P||Q) = sum_x P(x) log(P(x)/Q(x)); infinite when Q(x) = 0 < P(x)."""
    return _sum_on_support(p, q, lambda ps, qs: ps * (np.log(ps) - np.log(qs)), base)


def cross_entropy(p: Sequence[float], q: Sequence[float], *, base: float = math.e) -> float:
    """Cross-entropy H(P,Q) = -sum_x P(x) log Q(x), which equals H(P) + KL(P||Q)."""
    return _sum_on_support(p, q, lambda ps, qs: -ps * np.log(qs), base)


def label_smoothing(target: int, num_classes: int, epsilon: float) -> np.ndarray:
    """The smoothed target q'(k) = (1 - eps) * delta(k, target) + eps / K.

    The uniform eps/K share also goes to the target class, so q'(target) = 1 - eps + eps/K
    (the same convention as torch.nn.functional.cross_entropy(label_smoothing=eps)).
    """
    if num_classes < 1:
        raise LMForgeError(f"num_classes must be >= 1, got {num_classes}")
    if not 0 <= target < num_classes:
        raise LMForgeError(f"target {target} is outside 0..{num_classes - 1}")
    if not 0.0 <= epsilon <= 1.0:
        raise LMForgeError(f"label smoothing epsilon must be in [0, 1], got {epsilon}")
    q = np.full(num_classes, epsilon / num_classes)
    q[target] += 1.0 - epsilon
    return q


def label_smoothed_loss(
    logits: Sequence[float] | np.ndarray,
    target: int | Sequence[int],
    epsilon: float,
    *,
    base: float = math.e,
) -> float:
    """Cross-entropy between the label-smoothed target and softmax(logits).

    `logits` is (K,) with an int `target`, or (N, K) with N targets (the mean loss is returned).
    """
    z = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    targets = np.atleast_1d(np.asarray(target))
    if z.ndim != 2 or targets.ndim != 1 or len(targets) != z.shape[0]:
        raise LMForgeError(
            f"logits of shape {np.shape(logits)} do not match targets of shape {np.shape(target)}"
        )
    # log-softmax with the max subtracted so large logits do not overflow exp.
    shifted = z - z.max(axis=1, keepdims=True)
    log_q = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    smooth = np.stack([label_smoothing(int(t), z.shape[1], epsilon) for t in targets])
    losses = -(smooth * log_q).sum(axis=1) / math.log(base)
    return float(losses.mean())  # one row: its own loss
