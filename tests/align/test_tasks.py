"""Built-in verifiable tasks, the verifier, GSM8K and HH parsing."""

import pytest

from lmforge.align import tasks
from lmforge.errors import ConfigError, DataError


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_pairs_are_labelled_by_the_verifier(name):
    pairs = tasks.preference_pairs(name, 30, seed=3)
    for p in pairs:
        assert tasks.verify(p, p["chosen"]) == 1.0
        assert tasks.verify(p, p["rejected"]) == 0.0
        assert p["chosen"] != p["rejected"]


def test_arithmetic_answers_are_right():
    for r in tasks.problems("arith", 200, seed=1, digits=3):
        a, op, b = next(
            (r["prompt"][:i], c, r["prompt"][i + 1 : -1])
            for i, c in enumerate(r["prompt"])
            if c in "+-*" and i > 0
        )
        assert int(r["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                    "*": int(a) * int(b)}[op]  # fmt: skip
        assert int(r["answer"]) >= 0


def test_string_answers_are_right():
    assert tasks.StringTask("reverse").sample.__self__  # bound
    for r in tasks.problems("strings", 100, seed=2):
        word = r["prompt"].rstrip(":").split(" ")[-1]
        if r["task"] == "reverse":
            assert r["answer"] == word[::-1]
        elif r["task"] == "upper":
            assert r["answer"] == word.upper()
        elif r["task"] == "sort":
            assert r["answer"] == "".join(sorted(word))
        else:
            letter = r["prompt"].split(" ")[1]
            assert r["answer"] == str(word.count(letter))


def test_deterministic_and_split_disjoint():
    a = tasks.problems("add", 300, seed=5)
    assert a == tasks.problems("add", 300, seed=5)
    assert a != tasks.problems("add", 300, seed=6)
    test = tasks.problems("add", 300, seed=5, split="test")
    assert not {r["prompt"] for r in a} & {r["prompt"] for r in test}
    assert len({r["prompt"] for r in a}) == 300  # distinct


def test_too_many_problems_is_a_clear_error():
    with pytest.raises(ConfigError, match="distinct"):
        tasks.problems("add", 500, digits=1)


def test_verify_normalisation():
    rec = {"answer": "1234"}
    assert tasks.verify(rec, " 1,234.\nmore text") == 1.0
    assert tasks.verify(rec, "so the answer is #### 1234") == 1.0
    assert tasks.verify(rec, "1235") == 0.0
    assert tasks.verify({"answer": "abc"}, "ABC") == 0.0  # case matters for strings
    with pytest.raises(DataError):
        tasks.verify({}, "1")


def test_gsm8k_answer_and_loader(shared_data):
    assert tasks.gsm8k_answer("steps\n#### 1,080") == "1080"
    rows = tasks.load_gsm8k(shared_data / "gsm8k_test.jsonl", limit=20)
    assert len(rows) == 20 and all(r["answer"].lstrip("-").isdigit() for r in rows)
    assert tasks.verify(rows[0], rows[0]["solution"]) == 1.0


def test_parse_hh():
    out = tasks.parse_hh("\n\nHuman: hi\n\nAssistant: yo", "\n\nHuman: hi\n\nAssistant: no")
    assert out == {"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " yo", "rejected": " no"}
    msgs = tasks.hh_messages("\n\nHuman: hi\n\nAssistant: yo\n\nHuman: ok")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    with pytest.raises(DataError):
        tasks.parse_hh("no turns", "no turns")


def test_load_hh(shared_data):
    rows = tasks.load_hh(shared_data / "hh_harmless_base_test.jsonl.gz")
    assert len(rows) == 2312
    assert all(r["prompt"].endswith("\n\nAssistant:") for r in rows)


def test_bad_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        tasks.load_gsm8k(path)
