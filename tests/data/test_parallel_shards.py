"""Multi-process shard building: the same bytes as one process, bounded read-ahead, bad input."""

import itertools
import json

import pytest

from lmforge.data.shards import _encoded_batches, build_token_shards, prepare_corpus
from lmforge.errors import ConfigError
from lmforge.tokenizer import Tokenizer

DOCS = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 7 + 1)
        for i in range(300)]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_bpe(DOCS, vocab_size=300)


def test_two_workers_write_the_same_shards_as_one(tmp_path, tokenizer):
    source = tmp_path / "corpus.jsonl"
    source.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    metas = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        metas[workers] = prepare_corpus(
            str(source), tokenizer, out, split_by="documents", progress=False, workers=workers
        )
    assert metas[1] == metas[2] and metas[1]["num_documents"] == len(DOCS)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()


def test_read_ahead_is_bounded(tokenizer):
    """Workers get at most 2 batches each ahead of the writer, however long the corpus."""
    pulled = 0

    def endless():
        nonlocal pulled
        for i in itertools.count():
            pulled += 1
            yield [DOCS[i % len(DOCS)]] * 4

    batches = _encoded_batches(endless(), tokenizer, "uint16", workers=2)
    for _ in range(3):
        next(batches)
    assert pulled <= 3 + 2 * 2
    batches.close()


def test_workers_must_be_positive(tmp_path, tokenizer):
    with pytest.raises(ConfigError, match="workers must be a positive integer"):
        build_token_shards(DOCS, tokenizer, tmp_path, workers=0)
