import json

import numpy as np
import pytest

import lmforge.data.shards as shards
from lmforge.data import TokenShard, build_token_shards, builtin_corpus, prepare_corpus
from lmforge.errors import ConfigError, DataError
from lmforge.tokenizer import Tokenizer

DOCS = builtin_corpus("pydoc")[:12]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train_bpe(DOCS, vocab_size=512)


def expected_stream(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    return np.array([i for d in docs for i in tok.encode(d, add_eos=True)], dtype=np.uint16)


def test_shards_hold_documents_joined_with_eos_and_split_90_10(tok, tmp_path):
    meta = build_token_shards(iter(DOCS), tok, tmp_path, batch_docs=5, progress=False)
    stream = expected_stream(tok, DOCS)
    n_train = int(len(stream) * 0.9)
    assert meta["dtype"] == "uint16" and meta["eos_id"] == tok.eos_id == 1
    assert (meta["train_tokens"], meta["val_tokens"]) == (n_train, len(stream) - n_train)
    assert meta["num_documents"] == len(DOCS) and meta["vocab_size"] == 512
    assert json.loads((tmp_path / "meta.json").read_text()) == meta
    train = TokenShard.open(tmp_path / "train.bin")
    val = TokenShard.open(tmp_path / "val.bin")
    assert train.tokens.dtype == np.uint16 and len(train) == n_train
    np.testing.assert_array_equal(np.concatenate([train.tokens, val.tokens]), stream)
    assert (stream == tok.eos_id).sum() == len(DOCS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_split_by_documents_snaps_to_a_boundary(tok, tmp_path):
    meta = build_token_shards(DOCS, tok, tmp_path, split_by="documents", progress=False)
    train = TokenShard.open(tmp_path / "train.bin")
    assert train.tokens[-1] == tok.eos_id
    assert meta["train_tokens"] + meta["val_tokens"] == len(expected_stream(tok, DOCS))
    with pytest.raises(DataError, match="two documents"):
        build_token_shards(DOCS[:1], tok, tmp_path, split_by="documents", progress=False)


def test_val_fraction_zero_and_bad_args(tok, tmp_path):
    meta = build_token_shards(DOCS[:2], tok, tmp_path, val_fraction=0, progress=False)
    assert meta["val_tokens"] == 0 and (tmp_path / "val.bin").stat().st_size == 0
    with pytest.raises(ConfigError, match="val_fraction"):
        build_token_shards(DOCS, tok, tmp_path, val_fraction=1.0)
    with pytest.raises(ConfigError, match="split_by"):
        build_token_shards(DOCS, tok, tmp_path, split_by="lines")
    with pytest.raises(DataError, match="no non-empty documents"):
        build_token_shards(["", ""], tok, tmp_path, progress=False)
    assert shards.shard_dtype(65536) == "uint16" and shards.shard_dtype(65537) == "uint32"


def test_crash_leaves_no_partial_files(tok, tmp_path):
    def docs():
        yield from DOCS[:3]
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        build_token_shards(docs(), tok, tmp_path, batch_docs=1, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_token_shard_errors(tmp_path):
    with pytest.raises(DataError, match="not found: .*train.bin"):
        TokenShard.open(tmp_path / "train.bin")
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match="no meta.json"):
        TokenShard.open(tmp_path / "train.bin")
    with pytest.raises(DataError, match="not a multiple of 2"):
        TokenShard.open(tmp_path / "train.bin", dtype="uint16")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "float32"}))
    with pytest.raises(DataError, match="'dtype'"):
        TokenShard.open(tmp_path / "train.bin")
    (tmp_path / "val.bin").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        TokenShard.open(tmp_path / "val.bin", dtype="uint32")


def test_prepare_corpus_caches(tok, tmp_path, monkeypatch):
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": d}) for d in DOCS))
    out = tmp_path / "shards"
    meta = prepare_corpus(str(src), tok, out, progress=False)
    assert meta["source"] == str(src) and len(meta["fingerprint"]) == 64

    def fail(*args, **kwargs):
        raise AssertionError("cache miss")

    monkeypatch.setattr(shards, "build_token_shards", fail)
    assert prepare_corpus(str(src), tok, out, progress=False) == meta  # cache hit
    with pytest.raises(AssertionError, match="cache miss"):
        prepare_corpus(str(src), tok, out, val_fraction=0.2, progress=False)
    (out / "val.bin").write_bytes(b"")  # a damaged shard is rebuilt
    with pytest.raises(AssertionError, match="cache miss"):
        prepare_corpus(str(src), tok, out, progress=False)
