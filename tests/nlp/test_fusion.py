import pytest

from lmforge.errors import LMForgeError
from lmforge.nlp.fusion import reciprocal_rank_fusion


def test_rrf_hand_computed():
    bm25 = ["d1", "d2", "d3"]
    dense = ["d3", "d1", "d4"]
    fused = reciprocal_rank_fusion([bm25, dense])
    assert [d for d, _ in fused] == ["d1", "d3", "d2", "d4"]
    scores = dict(fused)
    assert scores["d1"] == pytest.approx(1 / 61 + 1 / 62)
    assert scores["d3"] == pytest.approx(1 / 63 + 1 / 61)
    assert scores["d2"] == pytest.approx(1 / 62)  # absent from `dense`: contributes 0 there
    assert scores["d4"] == pytest.approx(1 / 63)


def test_rrf_k_weights_ties_and_empty():
    fused = reciprocal_rank_fusion([[1, 2], [2, 1]], k=0)
    # Equal scores 1 + 1/2: first-seen order is kept.
    assert fused == [(1, pytest.approx(1.5)), (2, pytest.approx(1.5))]
    weighted = reciprocal_rank_fusion([["a"], ["b"]], weights=[1.0, 2.0])
    assert weighted == [("b", pytest.approx(2 / 61)), ("a", pytest.approx(1 / 61))]
    assert reciprocal_rank_fusion([]) == []
    assert reciprocal_rank_fusion([[], ["x"]]) == [("x", pytest.approx(1 / 61))]


def test_rrf_bad_input():
    with pytest.raises(LMForgeError, match="appears twice"):
        reciprocal_rank_fusion([["a", "a"]])
    with pytest.raises(LMForgeError, match="weights"):
        reciprocal_rank_fusion([["a"]], weights=[1, 2])
    with pytest.raises(LMForgeError, match="is a string"):
        reciprocal_rank_fusion(["abc"])
    with pytest.raises(LMForgeError, match="k must be"):
        reciprocal_rank_fusion([["a"]], k=-1)
