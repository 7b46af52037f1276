"""Chunking, sparse/dense/hybrid retrieval and RAG."""

from lmforge.retrieval.encoder import SentenceEncoder

__all__ = ["SentenceEncoder"]
