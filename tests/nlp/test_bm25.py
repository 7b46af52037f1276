import json
import math

import numpy as np
import pytest

from lmforge.errors import LMForgeError
from lmforge.nlp.bm25 import BM25Index, BM25Scorer
from lmforge.nlp.tfidf import inverse_document_frequency

SMALL = ["the cat sat", "the dog", "cat cat dog dog dog"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A fast brown fox leaps over lazy hounds in the forest.",
    "Dogs and cats are common household pets.",
    "The stock market rallied as tech shares rose.",
    "Investors sold shares when the market fell sharply.",
    "A fox was seen near the forest edge at dawn.",
    "Cats sleep most of the day; dogs need walks.",
    "The central bank raised interest rates again.",
    "Quick quick quick: the fox is quick.",
    "",
]
QUERIES = ["quick fox", "market shares", "cats dogs pets", "forest fox dawn", "bank rates"]


def test_idf():
    def bm25_idf(df, n_docs):
        return inverse_document_frequency(df, n_docs, "bm25")

    assert bm25_idf(2, 3) == pytest.approx(math.log(1.5 / 2.5 + 1))
    assert bm25_idf(3, 3) > 0
    with pytest.raises(LMForgeError, match="df <= n_docs"):
        bm25_idf(4, 3)


def test_scorer_hand_computed():
    bm = BM25Scorer(k1=1.5, b=0.75).index(SMALL)
    avgdl = 10 / 3
    idf_cat = math.log((3 - 2 + 0.5) / (2 + 0.5) + 1)
    norm0 = 1.5 * (1 - 0.75 + 0.75 * 3 / avgdl)
    assert bm.score("cat", 0) == pytest.approx(idf_cat * 1 * 2.5 / (1 + norm0))
    norm2 = 1.5 * (1 - 0.75 + 0.75 * 5 / avgdl)
    assert bm.score("cat", 2) == pytest.approx(idf_cat * 2 * 2.5 / (2 + norm2))
    assert bm.score("cat", 1) == 0.0
    # Repeated query terms count again, as the sum over q_i in Q does.
    assert bm.score("cat cat", 0) == pytest.approx(2 * bm.score("cat", 0))
    assert [d for d, _ in bm.search("cat")] == [2, 0]


def test_bm25s_index_agrees_with_formula():
    for k1, b in [(1.5, 0.75), (1.2, 0.75), (2.0, 0.3)]:
        ref = BM25Scorer(k1=k1, b=b).index(CORPUS)
        idx = BM25Index(k1=k1, b=b).index(CORPUS)
        assert len(idx) == len(CORPUS)
        for q in QUERIES:
            np.testing.assert_allclose(idx.scores(q), ref.scores(q), rtol=1e-5, atol=1e-6)
            assert [d for d, _ in idx.search(q, k=5)] == [d for d, _ in ref.search(q, k=5)]


def test_search_results():
    idx = BM25Index().index(CORPUS)
    hits = idx.search("quick fox", k=3)
    assert hits[0][0] == 8  # "quick" four times
    assert all(s > 0 for _, s in hits) and hits == sorted(hits, key=lambda h: -h[1])
    assert idx.search("zebra") == []
    assert len(idx.search("the", k=100)) == 8  # only documents containing "the"
    with pytest.raises(LMForgeError, match="k must be"):
        idx.search("fox", k=0)


def test_save_load_roundtrip_without_pickle(tmp_path):
    idx = BM25Index(k1=1.2, stopwords=True).index(CORPUS)
    idx.save(tmp_path / "bm25")
    files = sorted(p.name for p in (tmp_path / "bm25").iterdir())
    assert all(f.endswith((".npy", ".json")) for f in files), files
    for f in files:
        if f.endswith(".npy"):
            arr = np.load(tmp_path / "bm25" / f, allow_pickle=False)
            assert arr.dtype != object
        else:
            json.loads((tmp_path / "bm25" / f).read_text())
    loaded = BM25Index.load(tmp_path / "bm25")
    assert (loaded.k1, loaded.b, len(loaded)) == (1.2, 0.75, len(CORPUS))
    assert loaded.stopwords == idx.stopwords
    for q in QUERIES:
        assert loaded.search(q) == idx.search(q)
    mapped = BM25Index.load(tmp_path / "bm25", mmap=True)
    assert mapped.search("quick fox") == idx.search("quick fox")


def test_bad_input(tmp_path):
    with pytest.raises(LMForgeError, match="k1"):
        BM25Index(k1=-1)
    with pytest.raises(LMForgeError, match=r"b must be in \[0, 1\]"):
        BM25Scorer(b=2)
    with pytest.raises(LMForgeError, match="no documents"):
        BM25Index().index([])
    with pytest.raises(LMForgeError, match="no documents"):
        BM25Scorer().index([])
    with pytest.raises(LMForgeError, match="no terms"):
        BM25Index(stopwords=True).index(["", "the of"])
    with pytest.raises(LMForgeError, match="is empty"):
        BM25Index().search("x")
    with pytest.raises(LMForgeError, match="not a saved BM25Index"):
        BM25Index.load(tmp_path)
