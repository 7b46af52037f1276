"""BM25 ranking: a scorer written from the formula, and a fast index built on `bm25s`.

    score(D, Q) = sum_{q in Q} IDF(q) * f(q,D) (k1 + 1) / (f(q,D) + k1 (1 - b + b |D| / avgdl))
    IDF(q)      = ln((N - df + 0.5) / (df + 0.5) + 1)     (tfidf.inverse_document_frequency "bm25")

This is the classic Robertson/Sparck Jones weighting with the "+1" inside the log that Lucene
uses so IDF stays positive. bm25s implements it as method="lucene" but drops the constant
factor (k1 + 1), which does not change the ranking; BM25Index multiplies it back so both classes
return the same numbers. Query terms are summed with repetition, as in the formula.
"""

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import bm25s
import numpy as np

from lmforge.errors import LMForgeError
from lmforge.nlp.text import doc_tokens, resolve_stopwords
from lmforge.nlp.tfidf import inverse_document_frequency, top_k

Doc = str | Sequence[str]
_CONFIG = "lmforge_bm25.json"
_SETTINGS = ("k1", "b", "lowercase", "stopwords")  # what a saved index keeps of the constructor's


class _BM25:
    """What both rankers share: the parameters, the text handling (strings are tokenized, token
    lists are used as given) and top-k search; `index(docs)` and `scores` are each one's own."""

    def __init__(
        self,
        *,
        k1: float = 1.5,
        b: float = 0.75,
        lowercase: bool = True,
        stopwords: bool | Iterable[str] | None = None,
    ) -> None:
        if k1 < 0:
            raise LMForgeError(f"BM25 k1 must be >= 0 (usually 1.2 to 2.0), got {k1}")
        if not 0.0 <= b <= 1.0:
            raise LMForgeError(f"BM25 b must be in [0, 1], got {b}")
        self.k1, self.b = k1, b
        self.lowercase, self.stopwords = lowercase, resolve_stopwords(stopwords)

    def _tokens(self, doc: Doc) -> list[str]:
        return doc_tokens(doc, lowercase=self.lowercase, stopwords=self.stopwords)

    def search(self, query: Doc, k: int = 10) -> list[tuple[int, float]]:
        """The k best (doc_index, score) pairs, ties by lower index; documents sharing no query
        term are left out."""
        return top_k(self.scores(query), k)


class BM25Scorer(_BM25):
    """BM25 computed term by term in Python: slow, but every number can be traced to the formula.
    `BM25Scorer(**settings).index(docs)`, like BM25Index."""

    def index(self, docs: Sequence[Doc]) -> "BM25Scorer":
        """Count the terms of `docs` (texts or token lists); returns self."""
        if len(docs) == 0:
            raise LMForgeError("BM25Scorer: no documents given")
        self.term_counts = [Counter(self._tokens(d)) for d in docs]
        self.doc_lengths = [sum(c.values()) for c in self.term_counts]
        self.avgdl = sum(self.doc_lengths) / len(docs)
        self.doc_freqs = Counter(t for c in self.term_counts for t in c)
        return self

    def score(self, query: Doc, doc_index: int) -> float:
        """BM25 score of document `doc_index` for `query`."""
        counts, length = self.term_counts[doc_index], self.doc_lengths[doc_index]
        n = len(self.term_counts)
        # avgdl is 0 only when every document is empty; then no term matches anyway.
        norm = self.k1 * (1 - self.b + self.b * length / self.avgdl) if self.avgdl else self.k1
        total = 0.0
        for q in self._tokens(query):
            f = counts.get(q, 0)
            if f:
                idf = inverse_document_frequency(self.doc_freqs[q], n, "bm25")
                total += idf * f * (self.k1 + 1) / (f + norm)
        return total

    def scores(self, query: Doc) -> np.ndarray:
        """BM25 scores of every document for `query`."""
        return np.array([self.score(query, i) for i in range(len(self.term_counts))])


class BM25Index(_BM25):
    """BM25 search at scale on the `bm25s` sparse index; saved as .npy + .json files, no pickle."""

    _bm25: bm25s.BM25 | None = None  # set by index() or load()
    n_docs = 0

    def index(self, docs: Sequence[Doc]) -> "BM25Index":
        """Build the index over `docs` (texts or token lists); returns self."""
        if len(docs) == 0:
            raise LMForgeError("BM25Index.index: no documents given")
        tokens = [self._tokens(d) for d in docs]
        if not any(tokens):
            raise LMForgeError("BM25Index.index: the documents contain no terms")
        bm25 = bm25s.BM25(k1=self.k1, b=self.b, method="lucene", backend="numpy")
        bm25.index(tokens, show_progress=False)
        self._bm25, self.n_docs = bm25, len(docs)
        return self

    def __len__(self) -> int:
        return self.n_docs

    def scores(self, query: Doc) -> np.ndarray:
        """BM25 scores of every indexed document for `query` (float32 precision)."""
        if self._bm25 is None:
            raise LMForgeError("BM25Index is empty: call index(docs) or BM25Index.load(dir) first")
        vocab = self._bm25.vocab_dict
        ids = [vocab[t] for t in self._tokens(query) if t in vocab and t != ""]
        if not ids:
            return np.zeros(self.n_docs)
        raw = self._bm25.get_scores_from_ids(ids)
        return np.asarray(raw, dtype=np.float64) * (self.k1 + 1)

    def save(self, directory: str | Path) -> None:
        """Write the index to `directory`: bm25s's CSC arrays (.npy, saved with allow_pickle=False),
        its vocab and params (.json), and this class's settings (lmforge_bm25.json)."""
        if self._bm25 is None:
            raise LMForgeError("BM25Index is empty: nothing to save")
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._bm25.save(path, allow_pickle=False, show_progress=False)
        settings = {k: getattr(self, k) for k in _SETTINGS} | {"stopwords": sorted(self.stopwords)}
        config = {"format": "lmforge.bm25/1", **settings, "n_docs": self.n_docs}
        (path / _CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")

    @classmethod
    def load(cls, directory: str | Path, *, mmap: bool = False) -> "BM25Index":
        """Read an index written by `save`; mmap=True maps the arrays instead of reading them."""
        path = Path(directory)
        try:
            config = json.loads((path / _CONFIG).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise LMForgeError(f"{path}: not a saved BM25Index ({e})") from e
        if config.get("format") != "lmforge.bm25/1":
            raise LMForgeError(f"{path / _CONFIG}: unknown format {config.get('format')!r}")
        index = cls(**{k: config[k] for k in _SETTINGS})
        try:
            # allow_pickle=False: a tampered .npy holding Python objects is refused, not executed.
            index._bm25 = bm25s.BM25.load(path, allow_pickle=False, mmap=mmap, show_progress=False)
        except (OSError, ValueError) as e:
            raise LMForgeError(f"{path}: cannot read the bm25s index files ({e})") from e
        index.n_docs = int(config["n_docs"])
        return index
