"""Corpora (built-in, files, folders, HF datasets), token shards on disk, and batch sampling."""

from lmforge.data.batches import BatchSampler, iterate_eval_batches, pad_collate
from lmforge.data.corpus import builtin_corpus, read_documents
from lmforge.data.shards import TokenShard, build_token_shards, prepare_corpus

__all__ = [
    "BatchSampler",
    "TokenShard",
    "build_token_shards",
    "builtin_corpus",
    "iterate_eval_batches",
    "pad_collate",
    "prepare_corpus",
    "read_documents",
]
