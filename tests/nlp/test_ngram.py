import math

import pytest

from lmforge.errors import LMForgeError
from lmforge.nlp.ngram import EOS, UNK, BigramLM

# The classic three-sentence corpus of Jurafsky & Martin, ch. 3.
CORPUS = ["I am Sam", "Sam I am", "I do not like green eggs and ham"]


def test_mle_bigram_probabilities():
    lm = BigramLM().fit(CORPUS)
    assert lm.prob("I", "<s>") == pytest.approx(2 / 3)
    assert lm.prob("Sam", "<s>") == pytest.approx(1 / 3)
    assert lm.prob("am", "I") == pytest.approx(2 / 3)
    assert lm.prob("do", "I") == pytest.approx(1 / 3)
    assert lm.prob("Sam", "am") == pytest.approx(1 / 2)
    assert lm.prob(EOS, "Sam") == pytest.approx(1 / 2)
    assert lm.prob("ham", "I") == 0.0


def test_sentence_probability_and_perplexity():
    lm = BigramLM().fit(CORPUS)
    # P(I|<s>) P(am|I) P(Sam|am) P(</s>|Sam) = 2/3 * 2/3 * 1/2 * 1/2
    assert lm.sentence_prob("I am Sam") == pytest.approx(1 / 9)
    assert lm.sentence_logprob(["I", "am", "Sam"], base=2) == pytest.approx(math.log2(1 / 9))
    # 4 predicted tokens (3 words + </s>).
    assert lm.perplexity(["I am Sam"]) == pytest.approx(9**0.25)
    assert lm.perplexity(["I like Sam"]) == math.inf
    assert lm.sentence_logprob("I like Sam") == -math.inf


def test_add_k_smoothing_normalises_and_handles_unseen():
    lm = BigramLM(k=1.0).fit(CORPUS)
    vocab = lm.vocab  # 10 words + </s> + <unk>
    assert len(vocab) == 12 and UNK in vocab
    # C(I am) = 2, C(I as history) = 3 -> (2 + 1) / (3 + 12)
    assert lm.prob("am", "I") == pytest.approx(3 / 15)
    for history in ["<s>", "I", "ham", "zebra"]:
        assert sum(lm.prob(w, history) for w in vocab) == pytest.approx(1.0)
    assert lm.prob("zebra", "I") == pytest.approx(1 / 15)
    assert math.isfinite(lm.perplexity(["I like zebras"]))


def test_bad_input():
    with pytest.raises(LMForgeError, match=">= 0"):
        BigramLM(k=-1)
    with pytest.raises(LMForgeError, match="no sentences"):
        BigramLM().fit([])
    with pytest.raises(LMForgeError, match="reserved"):
        BigramLM().fit(["a </s> b"])
    with pytest.raises(LMForgeError, match="not fitted"):
        BigramLM().prob("a", "b")
    with pytest.raises(LMForgeError, match="string tokens"):
        BigramLM().fit([[1, 2]])
