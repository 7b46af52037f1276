import math

import numpy as np
import pytest

from lmforge.errors import LMForgeError
from lmforge.nlp.tfidf import TfidfVectorizer, inverse_document_frequency, term_frequency, tfidf


def test_spec_vector_base10_and_ln():
    # 'cat' 3 times in 100 words; in 1,000 of 10,000,000 documents (Jurafsky & Martin, ch. 14).
    assert term_frequency(3, 100, 3) == pytest.approx(0.03)
    assert inverse_document_frequency(1000, 10_000_000, base=10) == pytest.approx(4.0)
    assert tfidf(3, 100, 1000, 10_000_000, base=10) == pytest.approx(0.12)
    assert tfidf(3, 100, 1000, 10_000_000) == pytest.approx(0.2763, abs=5e-5)


def test_tf_variants():
    # Document "a a a b": f(a) = 3, f(b) = 1, 4 tokens, max count 3.
    assert term_frequency(3, 4, 3, "raw") == 3.0
    assert term_frequency(3, 4, 3, "relative") == pytest.approx(0.75)
    assert term_frequency(1, 4, 3, "boolean") == 1.0
    assert term_frequency(0, 4, 3, "boolean") == 0.0
    assert term_frequency(3, 4, 3, "log") == pytest.approx(math.log(4))
    assert term_frequency(3, 4, 3, "log", base=2) == pytest.approx(2.0)
    assert term_frequency(1, 4, 3, "augmented") == pytest.approx(0.5 + 0.5 / 3)
    assert term_frequency(3, 4, 3, "augmented") == pytest.approx(1.0)
    assert term_frequency(0, 4, 3, "augmented") == 0.0
    with pytest.raises(LMForgeError, match="unknown TF variant"):
        term_frequency(1, 1, 1, "bm25")


def test_idf_variants():
    assert inverse_document_frequency(1, 10) == pytest.approx(math.log(10))
    assert inverse_document_frequency(1, 10, "smooth") == pytest.approx(math.log(11 / 2))
    assert inverse_document_frequency(1, 10, "sklearn") == pytest.approx(math.log(11 / 2) + 1)
    assert inverse_document_frequency(1, 10, "bm25") == pytest.approx(math.log(9.5 / 1.5 + 1))
    assert inverse_document_frequency(0, 10, "smooth") == pytest.approx(math.log(11))
    assert inverse_document_frequency(10, 10, "plain") == 0.0
    assert inverse_document_frequency(10, 10, "bm25") > 0  # the +1 keeps BM25 IDF positive
    with pytest.raises(LMForgeError, match="undefined for df = 0"):
        inverse_document_frequency(0, 10)
    with pytest.raises(LMForgeError, match="df <= n_docs"):
        inverse_document_frequency(11, 10)
    with pytest.raises(LMForgeError, match="unknown IDF variant"):
        inverse_document_frequency(1, 10, "probabilistic")


DOCS = [
    "The cat sat on the mat.",
    "The dog sat on the log.",
    "Cats and dogs are pets; the cat purrs.",
    "Stock markets fell sharply today.",
]


def test_vectorizer_hand_computed_weights():
    vec = TfidfVectorizer(tf="relative", idf="plain", norm=None)
    m = vec.fit_transform(DOCS)
    assert m.shape == (4, len(vec.vocabulary))
    # "cat" is 1 of 6 tokens in doc 0 and occurs in docs 0 and 2 of 4.
    assert m[0, vec.vocabulary["cat"]] == pytest.approx(1 / 6 * math.log(4 / 2))
    assert m[3, vec.vocabulary["cat"]] == 0.0


def test_vectorizer_matches_sklearn():
    sk = pytest.importorskip("sklearn.feature_extraction.text")
    from lmforge.nlp.text import tokenize

    ref = sk.TfidfVectorizer(tokenizer=tokenize, lowercase=False, token_pattern=None)
    expected = ref.fit_transform(DOCS).toarray()
    vec = TfidfVectorizer(tf="raw", idf="sklearn")
    got = vec.fit_transform(DOCS)
    assert list(vec.vocabulary) == list(ref.get_feature_names_out())
    np.testing.assert_allclose(got, expected, atol=1e-12)


def test_sparse_output_and_search():
    vec = TfidfVectorizer(stopwords=True).fit(DOCS)
    dense = vec.transform(DOCS)
    np.testing.assert_allclose(np.linalg.norm(dense, axis=1), 1.0)
    pytest.importorskip("scipy")
    np.testing.assert_allclose(vec.transform(DOCS, sparse=True).toarray(), dense)
    hits = vec.search("cat on a mat", k=2)
    assert hits[0][0] == 0
    assert hits[0][1] == pytest.approx(
        float(dense[0] @ vec.transform(["cat on a mat"])[0]), rel=1e-9
    )
    assert [d for d, _ in vec.search("markets")] == [3]
    assert vec.search("unknown words only") == []


def test_vectorizer_bad_input():
    with pytest.raises(LMForgeError, match="unknown TF variant"):
        TfidfVectorizer(tf="sublinear")
    with pytest.raises(LMForgeError, match="not fitted"):
        TfidfVectorizer().transform(["a"])
    with pytest.raises(LMForgeError, match="no documents"):
        TfidfVectorizer().fit([])
    with pytest.raises(LMForgeError, match="no terms"):
        TfidfVectorizer(stopwords=True).fit(["the of"])
    with pytest.raises(LMForgeError, match="k must be"):
        TfidfVectorizer().fit(DOCS).search("cat", k=0)
