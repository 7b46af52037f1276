"""Chunking, sparse/dense/hybrid retrieval and RAG; the other names live in the modules
(chunking, encoder, retriever, rag, evaluate)."""

from lmforge.retrieval.chunking import chunk_corpus
from lmforge.retrieval.encoder import SentenceEncoder
from lmforge.retrieval.rag import RAG
from lmforge.retrieval.retriever import Retriever

__all__ = ["RAG", "Retriever", "SentenceEncoder", "chunk_corpus"]
