"""Plain-text helpers for the classical NLP tools: sentence splitter, tokenizer, stopwords.

They are deliberately simple (regular expressions, no models) so every count in this package can be
checked by hand.
"""

import re
from collections.abc import Iterable, Sequence

from lmforge.errors import LMForgeError

# A small English stopword list (articles, pronouns, auxiliaries, prepositions, conjunctions).
# Kept short on purpose: it should remove glue words, not content words.
STOPWORDS: frozenset[str] = frozenset(
    """
    a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further
    had has have having he her here hers herself him himself his how i if in into is it its itself
    just me more most my myself no nor not now of off on once only or other our ours ourselves out
    over own same she should so some such than that the their theirs them themselves then there
    these they this those through to too under until up very was we were what when where which
    while who whom why will with would you your yours yourself yourselves
    """.split()
)

# A sentence ends at ., ! or ? (optionally followed by one closing quote/bracket, kept with it)
# followed by whitespace, or at a blank line.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+|\n\s*\n")
# Words are runs of letters/digits/underscore, keeping inner apostrophes ("don't", "o'clock").
_WORD = re.compile(r"\w+(?:['\u2019]\w+)*")


def split_sentences(text: str) -> list[str]:
    """Split `text` into sentences on ., ! or ? followed by whitespace (and on blank lines)."""
    if not isinstance(text, str):
        raise LMForgeError(f"split_sentences expects a string, got {type(text).__name__}")
    parts = (p.strip() for p in _SENTENCE_END.split(text))
    return [p for p in parts if p]


def resolve_stopwords(stopwords: bool | Iterable[str] | None) -> frozenset[str]:
    """Turn a `stopwords=` argument into a set: True = built-in STOPWORDS, None/False = none."""
    if stopwords is None or stopwords is False:
        return frozenset()
    if stopwords is True:
        return STOPWORDS
    if isinstance(stopwords, str):
        # A bare string would otherwise be read as a set of single characters.
        raise LMForgeError("stopwords must be True, None or a collection of words, not a string")
    return frozenset(w.lower() for w in stopwords)


def tokenize(
    text: str, *, lowercase: bool = True, stopwords: bool | Iterable[str] | None = None
) -> list[str]:
    """Split `text` into word tokens, optionally lowercased and with `stopwords` removed.

    `stopwords` is True for the built-in list, or any collection of words (compared lowercased).
    """
    if not isinstance(text, str):
        raise LMForgeError(f"tokenize expects a string, got {type(text).__name__}")
    return doc_tokens(text, lowercase=lowercase, stopwords=stopwords)


def doc_tokens(
    doc: str | Sequence[str],
    *,
    lowercase: bool = True,
    stopwords: bool | Iterable[str] | None = None,
) -> list[str]:
    """The tokens of a document given as text (tokenized) or as tokens (used as given), lowercased
    and with `stopwords` removed as asked: how every vectorizer and index here reads its input."""
    if isinstance(doc, str):
        tokens = _WORD.findall(doc.lower() if lowercase else doc)
    else:
        tokens = [t.lower() for t in doc] if lowercase else list(doc)
    stop = resolve_stopwords(stopwords)
    return [t for t in tokens if t.lower() not in stop]
