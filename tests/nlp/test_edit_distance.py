import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.errors import LMForgeError
from lmforge.nlp.edit_distance import EditCosts, SpellCorrector, edit_alignment, edit_distance

DICTIONARY = ["cat", "car", "cart", "care", "cards", "cast"]
# Levenshtein distance with unit costs (Jurafsky & Martin, ch. 2).
CARR = {"cat": 2, "car": 1, "cart": 1, "care": 1, "cards": 2, "cast": 2}


@pytest.mark.parametrize("word,expected", sorted(CARR.items()))
def test_spec_carr_distances(word, expected):
    assert edit_distance("carr", word) == expected
    assert edit_alignment("carr", word)[0] == expected  # the explicit DP


def test_known_distances():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3
    assert edit_distance("abc", "abc") == 0
    # Jurafsky & Martin: intention -> execution is 5 with unit costs, 8 with substitution = 2.
    assert edit_distance("intention", "execution") == 5
    assert edit_distance("intention", "execution", EditCosts(substitute=2)) == 8
    # Works on token sequences too (word-level edit distance).
    assert edit_distance("the cat sat".split(), "the cat sat down".split()) == 1


def test_weighted_costs():
    assert edit_distance("ab", "", EditCosts(delete=2.5)) == 5.0
    assert edit_distance("", "ab", EditCosts(insert=0.5)) == 1.0
    # A substitution dearer than delete + insert is never used.
    assert edit_distance("a", "b", EditCosts(substitute=5)) == 2
    with pytest.raises(LMForgeError, match="insert cost"):
        EditCosts(insert=-1)


def test_alignment_operations():
    dist, ops = edit_alignment("kitten", "sitting")
    assert dist == 3
    assert [o.op for o in ops if o.op != "match"] == ["substitute", "substitute", "insert"]
    assert ops[0].src == "k" and ops[0].dst == "s"
    dist, ops = edit_alignment("carr", "car")
    assert dist == 1 and sum(o.op == "delete" for o in ops) == 1


def _apply(a, ops):
    """Rebuild the target from the source and the alignment."""
    out = []
    for o in ops:
        if o.op in ("match", "substitute", "insert"):
            out.append(o.dst)
        assert o.op != "match" or a[o.i] == o.dst
    return "".join(out)


costs = st.sampled_from([(1, 1, 1), (1, 1, 2), (2, 1, 1), (0.5, 1.5, 1)])


@settings(max_examples=200, deadline=None)
@given(st.text("abcd", max_size=12), st.text("abcd", max_size=12))
def test_rapidfuzz_agrees_with_dp(a, b):
    assert edit_distance(a, b) == edit_alignment(a, b)[0]  # rapidfuzz vs the explicit DP


@settings(max_examples=100, deadline=None)
@given(st.text("abc", max_size=10), st.text("abc", max_size=10), costs)
def test_alignment_is_consistent(a, b, c):
    ins, dele, sub = c
    dist, ops = edit_alignment(a, b, EditCosts(ins, dele, sub))
    assert dist == pytest.approx(edit_distance(a, b, EditCosts(ins, dele, sub)))
    cost = {"match": 0, "substitute": sub, "insert": ins, "delete": dele}
    assert sum(cost[o.op] for o in ops) == pytest.approx(dist)
    assert _apply(a, ops) == b


def test_spell_corrector_spec_vector_and_tie_rule():
    sc = SpellCorrector(DICTIONARY)
    assert sc.distances("carr") == CARR
    # Equal frequencies: distance, then alphabetical.
    assert sc.candidates("carr") == [
        ("car", 1),
        ("care", 1),
        ("cart", 1),
        ("cards", 2),
        ("cast", 2),
        ("cat", 2),
    ]
    assert sc.correct("carr") == "car"
    freq = {"cat": 50, "car": 5, "cart": 10, "care": 5, "cards": 1, "cast": 1}
    assert SpellCorrector(freq).correct("carr") == "cart"  # most frequent at distance 1
    assert SpellCorrector({**freq, "cart": 1}).correct("carr") == "car"  # car ties care
    assert SpellCorrector(freq, max_distance=1).candidates("carr")[-1] == ("care", 1)
    assert sc.correct("cat") == "cat"
    assert sc.correct("xyzzy") == "xyzzy"


def test_spell_corrector_weighted_costs_use_dp():
    sc = SpellCorrector(DICTIONARY, costs=EditCosts(substitute=2), max_distance=2)
    # With substitution = 2, deleting the extra r (1) beats substituting it (2).
    assert sc.candidates("carr") == [("car", 1), ("care", 2), ("cart", 2)]


def test_spell_corrector_bad_input():
    with pytest.raises(LMForgeError, match="non-empty"):
        SpellCorrector([])
    with pytest.raises(LMForgeError, match="bad dictionary entry"):
        SpellCorrector({"a": -1})
    with pytest.raises(LMForgeError, match="max_distance"):
        SpellCorrector(["a"], max_distance=-1)
