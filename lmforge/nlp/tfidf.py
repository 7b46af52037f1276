"""TF-IDF: term-frequency and inverse-document-frequency variants, and a small vectorizer.

TF variants for a term with count f in a document of n tokens whose most frequent term has count m:
    raw f | relative f/n | boolean 1[f>0] | log log(1+f) | augmented 0.5 + 0.5 f/m
IDF variants for a term in df of N documents:
    plain   log(N/df)                          (the textbook form; needs df > 0)
    smooth  log((1+N)/(1+df))                  (add one to both counts, as in the 001 notes)
    sklearn log((1+N)/(1+df)) + 1              (scikit-learn's smooth_idf=True, always > 0)
    bm25    log((N-df+0.5)/(df+0.5) + 1)       (the Lucene BM25 form, always > 0)
The log base is configurable. Example: f=3 of n=100 words, df=1,000 of N=10,000,000 documents:
TF 0.03 x IDF log10(10^4) = 4 gives 0.12; with the natural log it is 0.03 x 9.2103 = 0.2763.
"""

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from lmforge.errors import LMForgeError, require_int
from lmforge.nlp.text import doc_tokens

if TYPE_CHECKING:
    from scipy.sparse import csr_matrix

# variant -> TF of a term counted f times in a document of n tokens whose top term counts m
_TF = {
    "raw": lambda f, n, m, base: float(f),
    "relative": lambda f, n, m, base: f / n if n else 0.0,
    "boolean": lambda f, n, m, base: float(f > 0),
    "log": lambda f, n, m, base: math.log1p(f) / math.log(base),
    # The formula is for terms present in d; an absent term weighs 0, as in the vectorizer.
    "augmented": lambda f, n, m, base: 0.5 + 0.5 * f / m if f > 0 else 0.0,
}
# variant -> IDF of a term found in df of n documents
_IDF = {
    "plain": lambda df, n, base: math.log(n / df, base),
    "smooth": lambda df, n, base: math.log((1 + n) / (1 + df), base),
    "sklearn": lambda df, n, base: math.log((1 + n) / (1 + df), base) + 1.0,
    "bm25": lambda df, n, base: math.log((n - df + 0.5) / (df + 0.5) + 1.0, base),
}


def _formula(kind: str, formulas: dict, variant: str):
    if variant not in formulas:
        choices = ", ".join(formulas)
        raise LMForgeError(f"unknown {kind} variant {variant!r}; choose from {choices}")
    return formulas[variant]


def term_frequency(
    count: float,
    doc_length: float,
    max_count: float,
    variant: str = "relative",
    *,
    base: float = math.e,
) -> float:
    """TF of a term seen `count` times in a document of `doc_length` tokens.

    `max_count` is the count of the document's most frequent term (used by 'augmented').
    """
    if count < 0:
        raise LMForgeError(f"term count must be >= 0, got {count}")
    return _formula("TF", _TF, variant)(count, doc_length, max_count, base)


def inverse_document_frequency(
    df: float, n_docs: float, variant: str = "plain", *, base: float = math.e
) -> float:
    """IDF of a term found in `df` of `n_docs` documents (see the module docstring)."""
    if n_docs <= 0 or df < 0 or df > n_docs:
        raise LMForgeError(f"need 0 <= df <= n_docs and n_docs > 0, got df={df}, n_docs={n_docs}")
    if variant == "plain" and df == 0:
        raise LMForgeError("plain IDF log(N/df) is undefined for df = 0; use variant='smooth'")
    return _formula("IDF", _IDF, variant)(df, n_docs, base)


def tfidf(
    count: float,
    doc_length: float,
    df: float,
    n_docs: float,
    *,
    tf: str = "relative",
    idf: str = "plain",
    base: float = math.e,
    max_count: float | None = None,
) -> float:
    """TF x IDF for one term in one document (`max_count` defaults to `count`)."""
    m = count if max_count is None else max_count
    tf_value = term_frequency(count, doc_length, m, tf, base=base)
    return tf_value * inverse_document_frequency(df, n_docs, idf, base=base)


def top_k(scores: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k best (doc_index, score) pairs of `scores`, best first, ties by lower index; documents
    scoring 0 are left out. np.partition keeps it O(n) before sorting the k candidates."""
    require_int("k", k)
    n = len(scores)
    cand = np.flatnonzero(scores >= np.partition(scores, n - k)[n - k]) if k < n else np.arange(n)
    order = cand[np.lexsort((cand, -scores[cand]))][:k]
    return [(int(i), float(scores[i])) for i in order if scores[i] > 0]


class TfidfVectorizer:
    """Fit a vocabulary and IDF weights on documents; produce doc-term matrices; search by cosine.

    Rows are L2-normalised when norm='l2' (the default), so the dot product of two rows is their
    cosine similarity. Terms seen in fewer than `min_df` documents are dropped.
    """

    def __init__(
        self,
        *,
        tf: str = "relative",
        idf: str = "smooth",
        base: float = math.e,
        norm: str | None = "l2",
        lowercase: bool = True,
        stopwords: bool | Iterable[str] | None = None,
        min_df: int = 1,
    ) -> None:
        _formula("TF", _TF, tf)  # unknown variants fail here, not at fit
        _formula("IDF", _IDF, idf)
        if norm not in ("l2", None):
            raise LMForgeError(f"norm must be 'l2' or None, got {norm!r}")
        self.tf, self.idf, self.base, self.norm = tf, idf, base, norm
        self.lowercase, self.stopwords, self.min_df = lowercase, stopwords, min_df
        self.vocabulary: dict[str, int] = {}
        self.idf_weights = np.zeros(0)
        self._docs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def _tokens(self, doc: str | Sequence[str]) -> list[str]:
        return doc_tokens(doc, lowercase=self.lowercase, stopwords=self.stopwords)

    def fit(self, docs: Sequence[str | Sequence[str]]) -> "TfidfVectorizer":
        """Learn the vocabulary (sorted) and IDF weights from `docs`; keeps them for `search`."""
        if len(docs) == 0:
            raise LMForgeError("TfidfVectorizer.fit: no documents given")
        counts = [Counter(self._tokens(d)) for d in docs]
        df = Counter(t for c in counts for t in c)
        terms = sorted(t for t, n in df.items() if n >= self.min_df)
        if not terms:
            raise LMForgeError("TfidfVectorizer.fit: the documents contain no terms")
        self.vocabulary = {t: i for i, t in enumerate(terms)}
        n = len(docs)
        self.idf_weights = np.array(
            [inverse_document_frequency(df[t], n, self.idf, base=self.base) for t in terms]
        )
        self._docs = self._csr(counts)
        return self

    def _csr(self, counts: list[Counter]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Weighted rows as CSR arrays (data, column indices, row pointers)."""
        data: list[float] = []
        cols: list[int] = []
        indptr = [0]
        for c in counts:
            length, top = sum(c.values()), max(c.values(), default=0)
            row = sorted(
                (self.vocabulary[t], term_frequency(f, length, top, self.tf, base=self.base))
                for t, f in c.items()
                if t in self.vocabulary
            )
            vals = np.array([w * self.idf_weights[j] for j, w in row], dtype=np.float64)
            if self.norm == "l2" and vals.size and np.linalg.norm(vals) > 0:
                vals /= np.linalg.norm(vals)
            data.extend(vals.tolist())
            cols.extend(j for j, _ in row)
            indptr.append(len(cols))
        return np.array(data), np.array(cols, dtype=np.int64), np.array(indptr, dtype=np.int64)

    def transform(
        self, docs: Sequence[str | Sequence[str]], *, sparse: bool = False
    ) -> "np.ndarray | csr_matrix":
        """Doc-term matrix (n_docs, n_terms): a dense numpy array, or with sparse=True a
        scipy.sparse.csr_matrix (scipy must be installed). Unknown terms are ignored."""
        if not self.vocabulary:
            raise LMForgeError("TfidfVectorizer is not fitted: call fit(docs) first")
        data, cols, indptr = self._csr([Counter(self._tokens(d)) for d in docs])
        shape = (len(docs), len(self.vocabulary))
        if sparse:
            try:
                from scipy.sparse import csr_matrix
            except ImportError as e:
                raise LMForgeError("sparse=True needs scipy; install it or use sparse=False") from e
            return csr_matrix((data, cols, indptr), shape=shape)
        dense = np.zeros(shape)
        dense[np.repeat(np.arange(shape[0]), np.diff(indptr)), cols] = data
        return dense

    def fit_transform(
        self, docs: Sequence[str | Sequence[str]], *, sparse: bool = False
    ) -> "np.ndarray | csr_matrix":
        """fit(docs) then transform(docs)."""
        return self.fit(docs).transform(docs, sparse=sparse)

    def search(self, query: str | Sequence[str], k: int = 10) -> list[tuple[int, float]]:
        """The k fitted documents most cosine-similar to `query`, as (doc_index, score), best
        first (ties by lower index). Documents with similarity 0 are left out."""
        q = self.transform([query])[0]  # refuses an unfitted vectorizer
        data, cols, indptr = self._docs
        n_docs = len(indptr) - 1
        rows = np.repeat(np.arange(n_docs), np.diff(indptr))
        # Sparse dot products and row norms: sum within each row via bincount on row ids.
        dots = np.bincount(rows, weights=data * q[cols], minlength=n_docs)
        dnorm = np.sqrt(np.bincount(rows, weights=data**2, minlength=n_docs))
        qnorm = np.linalg.norm(q)
        with np.errstate(divide="ignore", invalid="ignore"):
            cos = np.where((dnorm > 0) & (qnorm > 0), dots / (dnorm * qnorm), 0.0)
        return top_k(cos, k)
