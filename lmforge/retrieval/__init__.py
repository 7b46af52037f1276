"""Chunking, sparse/dense/hybrid retrieval and RAG."""

from lmforge.retrieval.chunking import (
    Chunk,
    Corpus,
    Document,
    chunk_corpus,
    chunk_documents,
    read_corpus,
    windows,
)
from lmforge.retrieval.encoder import SentenceEncoder
from lmforge.retrieval.rag import RAG, Answer, ExtractiveAnswerer, LMAnswerer
from lmforge.retrieval.retriever import SEARCH_MODES, Hit, Retriever

__all__ = [
    "RAG",
    "SEARCH_MODES",
    "Answer",
    "Chunk",
    "Corpus",
    "Document",
    "ExtractiveAnswerer",
    "Hit",
    "LMAnswerer",
    "Retriever",
    "SentenceEncoder",
    "chunk_corpus",
    "chunk_documents",
    "read_corpus",
    "windows",
]
