"""Bigram language model with MLE counts and optional add-k smoothing.

Each sentence is wrapped as <s> w1 ... wn </s>, so P(W) = P(w1|<s>) * prod P(wi|wi-1) * P(</s>|wn)
and the model also learns which words start and end sentences.

    P_MLE(w | v)   = C(v, w) / C(v)
    P_add-k(w | v) = (C(v, w) + k) / (C(v) + k |V|)

C(v) counts v as a history (the bigrams that start with v). V is the set of words that can be
predicted: the training words, </s>, and <unk>, which stands for every word unseen in training.
"""

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from lmforge.errors import LMForgeError

BOS = "<s>"
EOS = "</s>"
UNK = "<unk>"


def _tokens(sentence: str | Sequence[str]) -> list[str]:
    # A string is split on whitespace; callers who need another tokenization pass token lists.
    if isinstance(sentence, str):
        return sentence.split()
    if not all(isinstance(t, str) for t in sentence):
        raise LMForgeError("a sentence must be a string or a sequence of string tokens")
    return list(sentence)


class BigramLM:
    """A bigram language model: fit on sentences, then score sentences and compute perplexity."""

    def __init__(self, k: float = 0.0) -> None:
        if k < 0:
            raise LMForgeError(f"add-k smoothing constant must be >= 0, got {k}")
        self.k = float(k)
        self.bigram_counts: Counter[tuple[str, str]] = Counter()
        self.history_counts: Counter[str] = Counter()
        self.vocab: set[str] = set()

    def fit(self, sentences: Iterable[str | Sequence[str]]) -> "BigramLM":
        """Count bigrams (with <s> and </s> markers) over `sentences`; returns self."""
        n = 0
        for sentence in sentences:
            toks = _tokens(sentence)
            for t in toks:
                if t in (BOS, EOS, UNK):
                    raise LMForgeError(f"the token {t!r} is reserved for the model's markers")
            padded = [BOS, *toks, EOS]
            self.bigram_counts.update(zip(padded, padded[1:]))
            self.history_counts.update(padded[:-1])
            self.vocab.update(toks)
            n += 1
        if n == 0:
            raise LMForgeError("BigramLM.fit: no sentences given")
        self.vocab.update((EOS, UNK))
        return self

    def _map(self, word: str) -> str:
        return word if word in self.vocab or word == BOS else UNK

    def prob(self, word: str, prev: str) -> float:
        """P(word | prev); unseen words are scored as <unk>.

        Under MLE an unseen history has no estimate; it is given probability 0.
        """
        if not self.vocab:
            raise LMForgeError("BigramLM is not fitted: call fit(sentences) first")
        v, w = self._map(prev), self._map(word)
        count, history = self.bigram_counts[(v, w)], self.history_counts[v]
        if self.k == 0.0:
            return count / history if history else 0.0
        return (count + self.k) / (history + self.k * len(self.vocab))

    def sentence_logprob(self, sentence: str | Sequence[str], *, base: float = math.e) -> float:
        """log P(<s> sentence </s>) in `base`; -inf when any bigram has probability 0."""
        padded = [BOS, *_tokens(sentence), EOS]
        total = 0.0
        for v, w in zip(padded, padded[1:]):
            p = self.prob(w, v)
            if p == 0.0:
                return -math.inf
            total += math.log(p)
        return total / math.log(base)

    def sentence_prob(self, sentence: str | Sequence[str]) -> float:
        """P(<s> sentence </s>) as a plain probability (underflows for long sentences)."""
        return math.exp(self.sentence_logprob(sentence))

    def perplexity(self, sentences: Iterable[str | Sequence[str]]) -> float:
        """exp(-(1/N) sum log P) over all predicted tokens (the words and each </s>).

        <s> is given, never predicted, so it is not counted in N. Infinite if any bigram has
        probability 0 (use k > 0 to avoid that on unseen text).
        """
        total, n = 0.0, 0
        for sentence in sentences:
            total += self.sentence_logprob(sentence)  # -inf makes the perplexity exp(inf) = inf
            n += len(_tokens(sentence)) + 1
        if n == 0:
            raise LMForgeError("BigramLM.perplexity: no sentences given")
        return math.exp(-total / n)
