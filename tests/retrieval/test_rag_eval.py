"""The shipped question set is fair (paraphrased, one unambiguous gold topic, a real answer span,
no catch-all labels, fixed splits), scoring follows SQuAD, and bad question sets fail clearly."""

import json
import re

import pytest

from lmforge.cli.main import main
from lmforge.errors import DataError
from lmforge.retrieval import RAG, Retriever
from lmforge.retrieval.chunking import Document, chunk_corpus, chunk_documents
from lmforge.retrieval.evaluate import (
    PYDOC_QUESTIONS,
    Question,
    answer_scores,
    check_gold_topics,
    f1_score,
    load_questions,
    names_topic,
    normalize_answer,
    retrieval_scores,
    squad_exact_match,
)
from lmforge.retrieval.rag import Answer


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def pydoc_bm25():
    chunks, _ = chunk_corpus("builtin:pydoc", 120, 30)
    return Retriever.build(chunks, encoder=None)


@pytest.fixture(scope="module")
def questions():
    return load_questions()


def test_question_set_size_and_fixed_splits(questions):
    assert len(questions) >= 60
    assert len({q.id for q in questions}) == len(questions)
    val, test = load_questions(split="validation"), load_questions(split="test")
    assert len(val) >= 25 and len(test) >= 25 and len(val) + len(test) == len(questions)
    assert not {q.question for q in val} & {q.question for q in test}


def test_every_gold_topic_is_in_the_index(questions, pydoc_bm25):
    check_gold_topics(questions, pydoc_bm25, "shipped set")  # raises DataError otherwise
    indexed = {c.source for c in pydoc_bm25.chunks}
    assert all(f"pydoc:{q.topic}" in indexed for q in questions)


def test_questions_are_paraphrased_not_named_after_their_topic(questions):
    named = [(q.id, q.topic, names_topic(q.question, q.topic)) for q in questions]
    assert [n for n in named if n[2]] == []
    # the check itself catches names, stems and hyphenated parts
    assert names_topic("What does the break statement do?", "break") == "break"
    assert names_topic("When does an assertion fail?", "assert") == "assertion"
    assert names_topic("How do I sort a list?", "lists") == "list"
    assert names_topic("strip spaces from a string", "string-methods") == "string"
    assert names_topic("how do I delete a key", "del") is None  # short names: whole word only


def test_gold_answers_are_spans_of_their_one_gold_topic(questions):
    from pydoc_data.topics import topics

    docs = {k: _flat(v) for k, v in topics.items()}
    for q in questions:
        evidence = _flat(q.evidence)
        assert _flat(q.answer) in evidence, q.id
        assert len(normalize_answer(q.answer).split()) <= 12, q.id  # short answers
        # the evidence is in the gold topic and nowhere else: exactly one right source
        assert [k for k, text in docs.items() if evidence in text] == [q.topic], q.id


def test_no_catch_all_gold_topics(questions):
    """A catch-all topic repeats most paragraphs of two or more other topics (the 'compound'
    chapter holds 'for', 'while', 'try', ...): labelling a question with it rewards vague hits."""
    from pydoc_data.topics import topics

    flat = {k: _flat(v) for k, v in topics.items()}
    paragraphs = {
        k: [_flat(p) for p in re.split(r"\n\s*\n", v) if len(p.split()) >= 12]
        for k, v in topics.items()
    }

    def covers(big: str, small: str) -> bool:
        ps = paragraphs[small]
        return bool(ps) and sum(p in flat[big] for p in ps) >= 0.8 * len(ps)

    catch_all = {t for t in topics if sum(covers(t, u) for u in topics if u != t) >= 2}
    assert {"compound", "specialnames"} <= catch_all  # the rule finds the known ones
    assert not {q.topic for q in questions} & catch_all


def test_missing_gold_topic_is_one_clear_message(tmp_path, pydoc_bm25, capsys):
    rows = [json.loads(line) for line in PYDOC_QUESTIONS.read_text().splitlines()[:3]]
    rows[1]["topic"] = "no-such-topic"
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"1 gold topic\(s\) not in the index: 'no-such-topic'"):
        check_gold_topics(load_questions(path), pydoc_bm25, str(path))
    idx = tmp_path / "idx"
    pydoc_bm25.save(idx)
    args = ["rag", "eval", "--index", str(idx), "--questions", str(path), "--split", "all"]
    assert main(args + ["--out", str(tmp_path / "res.json")]) != 0
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("error: ") and f"{path}: 1 gold topic(s) not in the index" in err
    assert not (tmp_path / "res.json").exists()


def test_malformed_question_files(tmp_path):
    path = tmp_path / "q.jsonl"
    good = {"id": "a", "split": "test", "topic": "t", "question": "q?", "answer": "x",
            "evidence": "x y"}  # fmt: skip
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "b", "answer": ""}))
    with pytest.raises(DataError, match=r"q.jsonl:2: missing or empty string field\(s\) answer"):
        load_questions(path)
    path.write_text(json.dumps({**good, "split": "train"}) + "\n")
    with pytest.raises(DataError, match=r"q.jsonl:1: split 'train' is not one of"):
        load_questions(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(DataError, match="q.jsonl:2: duplicate id 'a'"):
        load_questions(path)


def test_answer_scoring_matches_the_official_squad_script():
    squad = pytest.importorskip("lm_eval.tasks.qasper.metrics")  # a copy of SQuAD v1.1's script
    pairs = [
        ("The Paris.", "paris"),
        ("an apple, a pear", "Apple pear"),
        ('"None" [1]', '"None"'),
        ("It returns -1 if sub is not found", '"-1"'),
        ("floor division by pow(2,n)", 'floor division by "pow(2,n)"'),
        ("", "x"),
        ("LIFO (last-in, first-out) order", "last in first out"),
    ]
    for pred, gold in pairs:
        assert normalize_answer(pred) == squad.normalize_answer(pred)
        assert f1_score(pred, gold) == pytest.approx(squad.f1_abstractive([pred], [gold]))
        assert squad_exact_match(pred, gold) == float(
            squad.normalize_answer(pred) == squad.normalize_answer(gold)
        )


DOCS = [
    Document("loops", "Loops", "The break statement leaves the nearest enclosing loop early."),
    Document("funcs", "Functions", "A def statement defines a function. A loop can call it."),
    Document("dicts", "Dicts", "A dictionary maps keys to values; get returns a default value."),
]


def _q(id_, topic, question, answer):
    return Question(id_, "test", topic, question, answer, answer)


def test_retrieval_scores_use_the_rank_of_the_first_gold_chunk():
    r = Retriever.build(chunk_documents(DOCS, 50, 5), encoder=None)
    qs = [_q("a", "loops", "leave the enclosing loop early", "x"),
          _q("b", "funcs", "loop", "x"),
          _q("c", "dicts", "zebra", "x")]  # fmt: skip
    ranks = []
    for q in qs:
        hits = r.search(q.question, 3, "bm25")
        ranks.append(next((h.rank for h in hits if h.chunk.source == q.topic), None))
    assert ranks == [1, 2, None]  # the fixture's premise
    s = retrieval_scores(r, qs, "bm25", (1, 2, 3))
    assert s["recall@1"] == pytest.approx(1 / 3) and s["recall@2"] == pytest.approx(2 / 3)
    assert s["recall@3"] == pytest.approx(2 / 3)
    assert s["mrr@10"] == pytest.approx((1 + 1 / 2) / 3)


def test_answer_scores_strip_citations_and_count_cited_gold(monkeypatch):
    r = Retriever.build(chunk_documents(DOCS, 50, 5), encoder=None)
    rag = RAG(r, k=2, mode="bm25")
    replies = {"enclosing loop early": "the nearest enclosing loop [2]", "map keys": "keys [1]"}

    def fake(question, hits):
        return Answer(replies[question], hits, kind="generated")

    monkeypatch.setattr(rag.answerer, "answer", fake)
    qs = [_q("a", "loops", "enclosing loop early", "the nearest enclosing loop"),
          _q("b", "dicts", "map keys", "maps keys to values")]  # fmt: skip
    summary, rows = answer_scores(rag, qs)
    assert rows[0]["sources"] == ["loops", "funcs"] and rows[0]["cited"] == ["funcs"]
    assert rows[1]["sources"][0] == "dicts" and rows[1]["cited"] == ["dicts"]
    assert [row["em"] for row in rows] == [1.0, 0.0]  # "[2]" is not part of the answer
    assert rows[1]["f1"] == pytest.approx(0.4)  # 1 of 1 predicted, 1 of 4 gold tokens
    assert summary["exact_match"] == 0.5 and summary["f1"] == pytest.approx(0.7)
    assert summary["cites_gold"] == 0.5 and summary["gold_in_passages"] == 1.0
