"""Classical NLP toolkit: bigram LM, metrics, edit distance, PMI, TF-IDF, BM25, RRF, TextRank."""

from lmforge.nlp.bm25 import BM25Index, BM25Scorer, bm25_idf
from lmforge.nlp.cooccurrence import (
    PMI,
    cooccurrence_counts,
    cooccurrence_matrix,
    tokenize_sentences,
)
from lmforge.nlp.edit_distance import (
    EditCosts,
    EditOp,
    SpellCorrector,
    edit_alignment,
    edit_distance,
)
from lmforge.nlp.fusion import reciprocal_rank_fusion
from lmforge.nlp.metrics import (
    cross_entropy,
    entropy,
    kl_divergence,
    label_smoothed_loss,
    label_smoothing,
    perplexity_from_nll,
    precision_recall_f1,
    precision_recall_f1_from_labels,
)
from lmforge.nlp.ngram import BOS, EOS, UNK, BigramLM
from lmforge.nlp.text import STOPWORDS, split_sentences, tokenize
from lmforge.nlp.textrank import (
    pagerank,
    sentence_similarity,
    textrank_keywords,
    textrank_sentences,
)
from lmforge.nlp.tfidf import (
    TfidfVectorizer,
    inverse_document_frequency,
    term_frequency,
    tfidf,
)

__all__ = [
    "BOS",
    "EOS",
    "PMI",
    "STOPWORDS",
    "UNK",
    "BM25Index",
    "BM25Scorer",
    "BigramLM",
    "EditCosts",
    "EditOp",
    "SpellCorrector",
    "TfidfVectorizer",
    "bm25_idf",
    "cooccurrence_counts",
    "cooccurrence_matrix",
    "cross_entropy",
    "edit_alignment",
    "edit_distance",
    "entropy",
    "inverse_document_frequency",
    "kl_divergence",
    "label_smoothed_loss",
    "label_smoothing",
    "pagerank",
    "perplexity_from_nll",
    "precision_recall_f1",
    "precision_recall_f1_from_labels",
    "reciprocal_rank_fusion",
    "sentence_similarity",
    "split_sentences",
    "term_frequency",
    "textrank_keywords",
    "textrank_sentences",
    "tfidf",
    "tokenize",
    "tokenize_sentences",
]
