import pytest

from lmforge.errors import LMForgeError
from lmforge.nlp.text import STOPWORDS, resolve_stopwords, split_sentences, tokenize


def test_split_sentences_keeps_punctuation_and_closing_quotes():
    text = 'The cat sat. The dog ran!  Really? "Yes." Done\n\nNew paragraph'
    assert split_sentences(text) == [
        "The cat sat.",
        "The dog ran!",
        "Really?",
        '"Yes."',
        "Done",
        "New paragraph",
    ]
    assert split_sentences("   ") == []


def test_tokenize_lowercases_keeps_apostrophes_and_drops_stopwords():
    assert tokenize("Don't STOP, it's 5 o'clock") == ["don't", "stop", "it's", "5", "o'clock"]
    assert tokenize("The Cat", lowercase=False) == ["The", "Cat"]
    assert tokenize("The cat sat on the mat", stopwords=True) == ["cat", "sat", "mat"]
    assert tokenize("The cat sat", stopwords=["CAT"]) == ["the", "sat"]


def test_stopwords_argument_and_bad_input():
    assert resolve_stopwords(True) is STOPWORDS
    assert resolve_stopwords(None) == frozenset() == resolve_stopwords(False)
    with pytest.raises(LMForgeError, match="not a string"):
        resolve_stopwords("the")
    with pytest.raises(LMForgeError, match="expects a string"):
        tokenize(["a"])
    with pytest.raises(LMForgeError, match="expects a string"):
        split_sentences(3)
