import math

import pytest

from lmforge.errors import LMForgeError
from lmforge.nlp.cooccurrence import (
    PMI,
    cooccurrence_counts,
    cooccurrence_matrix,
    tokenize_sentences,
)

TEXT = "The cat sat on the mat. The dog sat on the mat."
# The forward co-occurrence table of the 001 notes (row word before column word).
SEED = {
    ("the", "cat"): 1,
    ("the", "dog"): 1,
    ("the", "mat"): 2,
    ("cat", "sat"): 1,
    ("dog", "sat"): 1,
    ("sat", "on"): 2,
    ("on", "the"): 2,
}


def test_counts_match_the_seed_table_and_stay_inside_sentences():
    counts = cooccurrence_counts(TEXT)
    assert dict(counts) == SEED
    assert counts[("mat", "the")] == 0  # "mat. The" crosses a sentence boundary


def test_matrix():
    vocab, m = cooccurrence_matrix(TEXT)
    assert vocab == ["the", "cat", "sat", "on", "mat", "dog"]
    assert m.sum() == 10
    for (x, y), c in SEED.items():
        assert m[vocab.index(x), vocab.index(y)] == c


def test_sentence_inputs():
    assert tokenize_sentences(["A b", ["C", "d"]]) == [["a", "b"], ["c", "d"]]
    assert tokenize_sentences([["C", "d"]], lowercase=False) == [["C", "d"]]
    counts = cooccurrence_counts([["x", "y"], ["y", "x"]])
    assert counts == {("x", "y"): 1, ("y", "x"): 1}


def test_pmi_two_and_three_words():
    pmi = PMI(TEXT)  # base 2
    # 12 tokens, 10 adjacent pairs, 8 triples.
    assert (pmi.n_tokens, pmi.n_pairs, pmi.n_triples) == (12, 10, 8)
    # p(sat,on) = 2/10, p(sat) = p(on) = 2/12
    assert pmi.pmi("sat", "on") == pytest.approx(math.log2(0.2 / (2 / 12) ** 2))
    assert pmi.pmi("sat", "on") == pytest.approx(math.log2(7.2))
    # p(sat,on,the) = 2/8, p(the) = 4/12
    assert pmi.pmi3("sat", "on", "the") == pytest.approx(math.log2(27))
    assert pmi.pmi("mat", "the") == -math.inf
    assert PMI(TEXT, base=math.e).pmi("Sat", "ON") == pytest.approx(math.log(7.2))
    with pytest.raises(LMForgeError, match="does not occur"):
        pmi.pmi("sat", "zebra")


def test_stopword_removal_before_pairing():
    counts = cooccurrence_counts(TEXT, stopwords=True)
    assert dict(counts) == {("cat", "sat"): 1, ("sat", "mat"): 2, ("dog", "sat"): 1}
    pmi = PMI(TEXT, stopwords=True)
    # tokens: cat sat mat dog sat mat (6); pairs 4
    assert pmi.pmi("sat", "mat") == pytest.approx(math.log2((2 / 4) / ((2 / 6) * (2 / 6))))
    # All three pairs have PMI log2(4.5); ties go to the more frequent pair, then alphabetical.
    top = pmi.top_pairs(2)
    assert [pair for pair, _ in top] == [("sat", "mat"), ("cat", "sat")]
    assert top[1][1] == pytest.approx(math.log2((1 / 4) / ((1 / 6) * (2 / 6))))
    assert top[0][1] == pytest.approx(math.log2(4.5))
    with pytest.raises(LMForgeError, match="no tokens"):
        PMI("the of and", stopwords=True)
