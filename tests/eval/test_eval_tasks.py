"""Answer extraction (GSM8K '####', numbers, choices), exact match, and `lmforge eval gsm8k`."""

import json

import pytest

from lmforge.cli.main import main
from lmforge.errors import DataError
from lmforge.eval.tasks import evaluate_gsm8k, gsm8k_prompt
from lmforge.tasks.answers import canonical_answer as normalize_number
from lmforge.tasks.answers import (
    exact_match,
    extract_choice,
    extract_gsm8k,
    extract_last_number,
    extract_numeric_answer,
)
from lmforge.tasks.gsm8k import load_gsm8k


@pytest.mark.parametrize(
    "text,expected",
    [("1,000", "1000"), ("$5", "5"), ("3.50", "3.5"), ("7.0", "7"), ("-0", "0"), ("12.", "12")],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_extractors():
    assert extract_gsm8k("She has 3+4=<<3+4=7>>7 apples.\n#### 7") == "7"
    assert extract_gsm8k("#### 1,234\nthen\n#### -5") == "-5"
    assert extract_gsm8k("no marker 12") is None
    assert extract_last_number("costs $1,200.50 then 3 more") == "3"
    assert extract_last_number("nothing") is None
    assert extract_numeric_answer("So the answer is $18. Check: 2 * 9") == "18"
    assert extract_numeric_answer("It is 4 then 5") == "5"
    assert extract_choice("The answer is (C).") == "C"
    assert extract_choice("I pick (b)") is None  # lowercase is not a choice letter
    assert extract_choice("B. because") == "B"
    assert extract_choice("answer is: d", n_choices=4) == "D"
    assert extract_choice("E", n_choices=4) is None


def test_exact_match():
    assert exact_match("1,000", "1000") and exact_match("3.50", "3.5")
    assert not exact_match(None, "3") and not exact_match("4", "3")


def test_extraction_is_100_percent_on_gsm8k_reference_solutions(shared_data):
    path = shared_data / "gsm8k_test.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(rows) == 1319
    for row in rows:
        body, _, tail = row["answer"].rpartition("####")
        reference = normalize_number(tail)
        assert extract_gsm8k(row["answer"]) == reference
        assert extract_numeric_answer(row["answer"]) == reference
        # the same solution written the way a model might end it
        assert extract_numeric_answer(f"{body}The answer is {tail.strip()}.") == reference
    assert [r["reference"] for r in load_gsm8k(path, limit=3)] == ["18", "3", "70000"]


def _write_gsm8k(path, n=3):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"}
            for i in range(1, n + 1)]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_gsm8k_prompt_and_bad_rows(tmp_path):
    rows = load_gsm8k(_write_gsm8k(tmp_path / "g.jsonl"))
    assert (
        gsm8k_prompt("Q?", rows[:1])
        == "Question: What is 1 + 1?\nAnswer: #### 2\n\nQuestion: Q?\nAnswer:"
    )
    cot = gsm8k_prompt("Q?", rows[:1], cot=True)
    assert "Answer: Let's think step by step. 1+1=2\n#### 2" in cot
    assert cot.endswith("Question: Q?\nAnswer: Let's think step by step.")
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(DataError, match="bad.jsonl:1: answer has no '#### <number>'"):
        load_gsm8k(tmp_path / "bad.jsonl")


def test_evaluate_gsm8k_scores_generated_answers(tiny_lm, tmp_path):
    rows = load_gsm8k(_write_gsm8k(tmp_path / "g.jsonl"))
    result = evaluate_gsm8k(tiny_lm, rows, shots=1, max_new_tokens=6)
    assert result.total == 2 and 0 <= result.correct <= 2  # a random model: any score
    assert all(s["ok"] == (s["pred"] == r["reference"]) for s, r in zip(result.samples, rows[1:]))


def test_cli_gsm8k_prints_accuracy_and_skips_without_data(tiny_lm, tmp_path, capsys):
    tiny_lm.save(tmp_path / "ckpt")
    data = _write_gsm8k(tmp_path / "g.jsonl")
    argv = ["eval", "gsm8k", "--checkpoint", str(tmp_path / "ckpt"), "--data", str(data)]
    assert main(argv + ["--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path / "r")]) == 0
    assert "gsm8k: accuracy" in capsys.readouterr().out
    assert (tmp_path / "r" / "report.md").is_file() and (tmp_path / "r" / "report.png").is_file()
    assert main(argv[:-1] + [str(tmp_path / "absent.jsonl")]) == 0
    assert "skipped: GSM8K data not found" in capsys.readouterr().err
