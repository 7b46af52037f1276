"""Sentence-bounded co-occurrence counts and pointwise mutual information (PMI).

Two words co-occur when they are adjacent (x immediately before y) inside one sentence; pairs
never cross a sentence boundary. Probabilities are relative frequencies:

    p(x) = C(x) / #tokens,  p(x, y) = C(x y) / #adjacent pairs,  p(x, y, z) = C(x y z) / #triples
    PMI(x, y)    = log p(x, y) / (p(x) p(y))
    PMI(x, y, z) = log p(x, y, z) / (p(x) p(y) p(z))

Stopwords, when removed, are dropped before pairing, so "sat on the mat" pairs "sat" with "mat".
"""

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from lmforge.errors import LMForgeError
from lmforge.nlp.text import doc_tokens, resolve_stopwords, split_sentences

Texts = str | Iterable[str | Sequence[str]]


def tokenize_sentences(
    corpus: Texts, *, lowercase: bool = True, stopwords: bool | Iterable[str] | None = None
) -> list[list[str]]:
    """Turn a corpus into token lists, one per sentence.

    `corpus` is a text (split into sentences), or an iterable of sentences given as strings
    (tokenized) or token lists (used as they are, apart from stopword removal).
    """
    sentences = split_sentences(corpus) if isinstance(corpus, str) else corpus
    stop = resolve_stopwords(stopwords)
    return [doc_tokens(s, lowercase=lowercase, stopwords=stop) for s in sentences]


def cooccurrence_counts(
    corpus: Texts, *, lowercase: bool = True, stopwords: bool | Iterable[str] | None = None
) -> Counter[tuple[str, str]]:
    """Counts of forward adjacent pairs (x, y) within sentences."""
    sentences = tokenize_sentences(corpus, lowercase=lowercase, stopwords=stopwords)
    return Counter(pair for toks in sentences for pair in zip(toks, toks[1:]))


def cooccurrence_matrix(
    corpus: Texts, *, lowercase: bool = True, stopwords: bool | Iterable[str] | None = None
) -> tuple[list[str], np.ndarray]:
    """(vocabulary in first-seen order, matrix M) with M[i, j] = count of word i before word j."""
    sentences = tokenize_sentences(corpus, lowercase=lowercase, stopwords=stopwords)
    vocab = list(dict.fromkeys(t for toks in sentences for t in toks))
    index = {w: i for i, w in enumerate(vocab)}
    m = np.zeros((len(vocab), len(vocab)), dtype=np.int64)
    for (x, y), count in Counter(p for toks in sentences for p in zip(toks, toks[1:])).items():
        m[index[x], index[y]] = count
    return vocab, m


class PMI:
    """Unigram, adjacent-pair and adjacent-triple counts of a corpus, and their PMI scores."""

    def __init__(
        self,
        corpus: Texts,
        *,
        lowercase: bool = True,
        stopwords: bool | Iterable[str] | None = None,
        base: float = 2.0,
    ) -> None:
        self.sentences = tokenize_sentences(corpus, lowercase=lowercase, stopwords=stopwords)
        self.lowercase = lowercase
        self.base = base
        self.unigrams: Counter[str] = Counter()
        self.pairs: Counter[tuple[str, str]] = Counter()
        self.triples: Counter[tuple[str, str, str]] = Counter()
        for toks in self.sentences:
            self.unigrams.update(toks)
            self.pairs.update(zip(toks, toks[1:]))
            self.triples.update(zip(toks, toks[1:], toks[2:]))
        self.n_tokens = sum(self.unigrams.values())
        self.n_pairs = sum(self.pairs.values())
        self.n_triples = sum(self.triples.values())
        if self.n_tokens == 0:
            raise LMForgeError("PMI: the corpus has no tokens (after stopword removal)")

    def _pmi(self, counts: Counter, total: int, words: tuple[str, ...]) -> float:
        """log p(words) / prod p(word), -inf when the n-gram never occurs."""
        key = tuple(w.lower() if self.lowercase else w for w in words)
        ratio = counts[key] / total if total else 0.0
        for word, w in zip(words, key):
            if w not in self.unigrams:
                raise LMForgeError(f"PMI: the word {word!r} does not occur in the corpus")
            ratio /= self.unigrams[w] / self.n_tokens
        return math.log(ratio) / math.log(self.base) if ratio > 0 else -math.inf

    def pmi(self, x: str, y: str) -> float:
        """PMI of the ordered adjacent pair "x y"; -inf when the pair never occurs."""
        return self._pmi(self.pairs, self.n_pairs, (x, y))

    def pmi3(self, x: str, y: str, z: str) -> float:
        """PMI of the ordered adjacent triple "x y z"; -inf when the triple never occurs."""
        return self._pmi(self.triples, self.n_triples, (x, y, z))

    def top_pairs(self, k: int = 10, *, min_count: int = 1) -> list[tuple[tuple[str, str], float]]:
        """The k observed pairs with the highest PMI (seen at least `min_count` times).

        Ties are broken by higher pair count, then alphabetically, so the order is stable.
        """
        scored = [(pair, self.pmi(*pair)) for pair, c in self.pairs.items() if c >= min_count]
        scored.sort(key=lambda ps: (-ps[1], -self.pairs[ps[0]], ps[0]))
        return scored[:k]
