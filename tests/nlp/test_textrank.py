import math

import networkx as nx
import pytest

from lmforge.errors import LMForgeError
from lmforge.nlp.textrank import (
    pagerank,
    sentence_similarity,
    textrank_keywords,
    textrank_sentences,
)

GRAPH = {
    "a": {"b": 1.0, "c": 2.0},
    "b": {"c": 1.0},
    "c": {"a": 1.0, "d": 0.5},
    "d": {},  # dangling
    "e": {"a": 3.0, "d": 1.0},
}


def test_pagerank_matches_networkx():
    g = nx.DiGraph()
    g.add_nodes_from(GRAPH)
    for u, nbrs in GRAPH.items():
        for v, w in nbrs.items():
            g.add_edge(u, v, weight=w)
    ref = nx.pagerank(g, alpha=0.85, tol=1e-12, max_iter=1000)
    got = pagerank(GRAPH, tol=1e-12, max_iter=1000)
    assert got.keys() == ref.keys()
    for node in ref:
        assert got[node] == pytest.approx(ref[node], abs=1e-9)
    assert sum(got.values()) == pytest.approx(1.0)


def test_pagerank_known_small_graphs():
    # A directed 3-cycle is symmetric: every node gets 1/3.
    cycle = pagerank({1: {2: 1}, 2: {3: 1}, 3: {1: 1}})
    assert all(v == pytest.approx(1 / 3) for v in cycle.values())
    # a -> b with b dangling: only b's spread-out mass reaches a, x_a = 0.15/2 + 0.85 x_b/2,
    # and x_a + x_b = 1, so x_a = 1/2.85.
    two = pagerank({"a": {"b": 1}})
    xa = 1 / (2 + 0.85)
    assert two["a"] == pytest.approx(xa) and two["b"] == pytest.approx(1 - xa)
    assert pagerank({}) == {}
    with pytest.raises(LMForgeError, match="invalid weight"):
        pagerank({"a": {"b": -1}})
    with pytest.raises(LMForgeError, match="damping"):
        pagerank({"a": {"b": 1}}, damping=1.5)
    with pytest.raises(LMForgeError, match="did not converge"):
        pagerank(GRAPH, max_iter=2)


TEXT = (
    "Graph algorithms rank nodes in a graph. "
    "PageRank scores each graph node by its links. "
    "TextRank builds a graph of words and ranks the words with PageRank. "
    "Bananas are yellow."
)


def test_keywords():
    kws = textrank_keywords(TEXT, k=3)
    assert kws[0][0] == "graph"
    assert len(kws) == 3 and kws == sorted(kws, key=lambda ws: -ws[1])
    scores = dict(textrank_keywords(TEXT, k=100))
    assert sum(scores.values()) == pytest.approx(1.0)
    assert "the" not in scores and "a" not in scores  # stopwords and 1-letter words
    assert scores["graph"] > scores["bananas"]
    assert textrank_keywords("the of and", k=3) == []
    with pytest.raises(LMForgeError, match="window"):
        textrank_keywords(TEXT, window=1)


def test_sentence_similarity():
    assert sentence_similarity(["a", "b"], ["b", "c"]) == pytest.approx(1 / (2 * math.log(2)))
    assert sentence_similarity(["a"], ["a"]) == 1.0
    assert sentence_similarity(["a"], ["b"]) == 0.0


def test_sentences_in_original_order():
    top = textrank_sentences(TEXT, k=2)
    assert [i for i, _, _ in top] == sorted(i for i, _, _ in top)
    assert 3 not in [i for i, _, _ in top]  # the unrelated banana sentence
    assert top[0][1].startswith(("Graph", "PageRank", "TextRank"))
    everything = textrank_sentences(TEXT, k=10)
    assert len(everything) == 4
    assert sum(s for _, _, s in everything) == pytest.approx(1.0)
    # No shared words: all scores tie, so the first k sentences are kept.
    assert [i for i, _, _ in textrank_sentences(["x y", "z w", "u v"], k=2)] == [0, 1]
    assert textrank_sentences([], k=2) == []
