"""Multiple choice by log-likelihood from local JSONL."""

import json

import pytest

from lmforge.errors import DataError
from lmforge.eval.multiple_choice import evaluate_choices, load_choices
from lmforge.eval.prompts import qa_prompt
from lmforge.eval.scoring import loglikelihood

ROWS = [
    {"question": "What is 2 plus 2?", "choices": ["4", "5", "22"], "answer": 0},
    {"question": "Capital of France?", "choices": ["Rome", "Paris"], "answer": "B"},
    {"question": "Color of the sky?", "choices": ["blue", "green", "a very long red"], "answer": 0},
]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def test_load_accepts_index_or_letter(data):
    assert [r["answer"] for r in load_choices(data)] == [0, 1, 0]
    assert len(load_choices(data, limit=2)) == 2


@pytest.mark.parametrize(
    "row,match",
    [
        ({"question": "q", "choices": ["a"], "answer": 0}, "at least 2"),
        ({"question": "q", "choices": ["a", "b"], "answer": 2}, "index 0..1 or a letter"),
        ({"question": "q", "choices": ["a", "b"], "answer": "C"}, "index 0..1"),
        ({"choices": ["a", "b"], "answer": 0}, "'question'"),
    ],
)
def test_bad_rows_name_the_line(tmp_path, row, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=f"bad.jsonl:2: .*{match}"):
        load_choices(path)


def test_accuracy_is_the_argmax_of_choice_loglikelihoods(tiny_lm, data):
    rows = load_choices(data)
    acc, acc_norm = evaluate_choices(tiny_lm, rows)
    expected = expected_norm = 0
    for r in rows:
        lps = [lp for lp, _ in loglikelihood(tiny_lm, [(qa_prompt(r["question"]), f" {c}")
                                                        for c in r["choices"]])]  # fmt: skip
        norm = [lp / len(c) for lp, c in zip(lps, r["choices"])]
        expected += lps.index(max(lps)) == r["answer"]
        expected_norm += norm.index(max(norm)) == r["answer"]
    assert (acc.correct, acc_norm.correct, acc.total) == (expected, expected_norm, 3)
    assert acc.accuracy == pytest.approx(expected / 3)
