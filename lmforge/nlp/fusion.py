"""Reciprocal Rank Fusion: merge several ranked lists into one without comparing their scores.

    RRF(d) = sum over lists r of 1 / (k + rank_r(d)),   k = 60, ranks start at 1

A document missing from a list gets nothing from it. Because only ranks are used, BM25 scores
and cosine similarities (which live on different scales) can be fused directly.
"""

from collections import Counter
from collections.abc import Hashable, Sequence

from lmforge.errors import LMForgeError


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[Hashable]],
    *,
    k: float = 60.0,
    weights: Sequence[float] | None = None,
) -> list[tuple[Hashable, float]]:
    """Fuse ranked lists of document ids (best first) into [(doc_id, score)], best first.

    `weights` optionally scales each list's contribution (default 1 each). Ties keep the order in
    which documents were first seen (list by list, rank by rank), so the result is deterministic.
    For retriever output of (doc_id, score) pairs pass `[d for d, _ in results]`.
    """
    if k < 0:
        raise LMForgeError(f"RRF k must be >= 0, got {k}")
    if weights is None:
        weights = [1.0] * len(rankings)
    if len(weights) != len(rankings):
        raise LMForgeError(f"got {len(weights)} weights for {len(rankings)} ranked lists")
    scores: dict[Hashable, float] = {}
    for n, (ranking, w) in enumerate(zip(rankings, weights)):
        if isinstance(ranking, str):
            raise LMForgeError(f"ranked list {n} is a string; pass a list of document ids")
        if twice := [doc for doc, count in Counter(ranking).items() if count > 1]:
            raise LMForgeError(f"document {twice[0]!r} appears twice in ranked list {n}")
        for rank, doc in enumerate(ranking, start=1):
            scores[doc] = scores.get(doc, 0.0) + w / (k + rank)
    # sorted() is stable, so equal scores stay in first-seen order.
    return sorted(scores.items(), key=lambda ds: -ds[1])
