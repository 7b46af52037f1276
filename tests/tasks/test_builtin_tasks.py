"""Built-in verifiable tasks, the answer normaliser and verifier, GSM8K and HH parsing."""

from collections import Counter

import pytest

from lmforge.errors import ConfigError, DataError
from lmforge.tasks import answers, gsm8k, hh, synthetic

SPLITS = ("train", "validation", "test")


@pytest.mark.parametrize("name", list(synthetic.TASKS))
def test_pairs_are_labelled_by_the_verifier(name):
    pairs = synthetic.preference_pairs(name, 30, seed=3)
    for p in pairs:
        assert answers.verify(p, p["chosen"]) == 1.0
        assert answers.verify(p, p["rejected"]) == 0.0
        assert p["chosen"] != p["rejected"]


def test_arithmetic_answers_are_right():
    for r in synthetic.problems("arith", 200, seed=1, digits=3):
        a, op, b = next(
            (r["prompt"][:i], c, r["prompt"][i + 1 : -1])
            for i, c in enumerate(r["prompt"])
            if c in "+-*" and i > 0
        )
        assert int(r["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                    "*": int(a) * int(b)}[op]  # fmt: skip
        assert int(r["answer"]) >= 0


def test_string_answers_are_right():
    assert synthetic.StringTask("reverse").sample.__self__  # bound
    for r in synthetic.problems("strings", 100, seed=2):
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
    a = synthetic.problems("add", 300, seed=5)
    assert a == synthetic.problems("add", 300, seed=5)
    assert a != synthetic.problems("add", 300, seed=6)
    assert len({r["prompt"] for r in a}) == 300  # distinct
    parts = {s: {r["prompt"] for r in synthetic.problems("add", 300, 5, s)} for s in SPLITS}
    assert not parts["train"] & (parts["validation"] | parts["test"])
    assert not parts["validation"] & parts["test"]
    counts = Counter(s for p in synthetic.problems("add", 5000, 0, "all", digits=3)
                     for s in SPLITS if synthetic.in_split(p["prompt"], s))  # fmt: skip
    assert counts["train"] + counts["validation"] + counts["test"] == 5000  # one split each
    assert all(0.17 < counts[s] / 5000 < 0.23 for s in ("validation", "test"))


def test_too_many_problems_is_a_clear_error():
    with pytest.raises(ConfigError, match="distinct"):
        synthetic.problems("add", 500, digits=1)


def test_verify_normalisation():
    rec = {"answer": "1234"}
    assert answers.verify(rec, " 1,234.\nmore text") == 1.0
    assert answers.verify(rec, "so the answer is #### 1234") == 1.0
    assert answers.verify(rec, "1235") == 0.0
    assert answers.verify({"answer": "abc"}, "ABC") == 0.0  # case matters for strings
    with pytest.raises(DataError):
        answers.verify({}, "1")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("1,000", "1000"),
        ("$5", "5"),
        ("+7", "7"),
        ("007", "7"),
        ("3.50", "3.5"),
        ("-0", "0"),
        ("12.", "12"),
        ("12345678901234567891", "12345678901234567891"),  # a float would round it
        (" Paris. ", "Paris"),
        ("a b", "a b"),  # text keeps its inner spaces
    ],
)
def test_canonical_answer(text, expected):
    assert answers.canonical_answer(text) == expected


def test_exact_match_is_the_verifier_comparison():
    assert answers.exact_match("1,000", "1000") and answers.exact_match("3.50", "3.5")
    assert not answers.exact_match(None, "3") and not answers.exact_match("4", "3")
    assert not answers.exact_match("12345678901234567891", "12345678901234567890")


def test_gsm8k_answer_and_loader(shared_data):
    assert gsm8k.gsm8k_answer("steps\n#### 1,080") == "1080"
    rows = gsm8k.load_gsm8k(shared_data / "gsm8k_test.jsonl", limit=20)
    assert len(rows) == 20 and all(r["reference"].lstrip("-").isdigit() for r in rows)
    # the verifier reads a worked solution's '#### n' line, as a trained model writes it
    assert answers.verify({"answer": rows[0]["reference"]}, rows[0]["answer"]) == 1.0


def test_parse_hh():
    out = hh.parse_hh("\n\nHuman: hi\n\nAssistant: yo", "\n\nHuman: hi\n\nAssistant: no")
    assert out == {"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " yo", "rejected": " no"}
    msgs = hh.hh_messages("\n\nHuman: hi\n\nAssistant: yo\n\nHuman: ok")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    with pytest.raises(DataError):
        hh.parse_hh("no turns", "no turns")


def test_load_hh(shared_data):
    rows = hh.load_hh(shared_data / "hh_harmless_base_test.jsonl.gz")
    assert len(rows) == 2312
    assert all(r["prompt"].endswith("\n\nAssistant:") for r in rows)


def test_bad_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2"):
        gsm8k.load_gsm8k(path)


def test_the_recipes_chat_arith_splits_are_disjoint_and_verified():
    """configs/recipes/*-arith-*.yaml read task:arith:2:SPLIT:chat with different seeds per
    split (train 1337, validation 1338, the benchmark's test 0): still no prompt is shared, each
    prompt is one user message, and the verifier accepts exactly the stated answer."""
    from lmforge.align.data import records_from

    seen = {}
    for split, seed in (("train", 1337), ("validation", 1338), ("test", 0)):
        rows = [r for _, r in records_from(f"task:arith:2:{split}:chat", "prompts", 400, seed)]
        assert all(len(r["prompt"]) == 1 and r["prompt"][0]["role"] == "user" for r in rows)
        seen[split] = {r["prompt"][0]["content"] for r in rows}
        assert len(seen[split]) == 400
        for r in rows:
            a, op, b = r["prompt"][0]["content"][:-1].partition(next(
                c for c in r["prompt"][0]["content"][1:] if c in "+-*"))  # fmt: skip
            assert int(r["answer"]) == eval(f"{int(a)}{op}{int(b)}")  # noqa: S307 (digits only)
            assert answers.verify(r, r["answer"]) == 1.0
            assert answers.verify(r, str(int(r["answer"]) + 1)) == 0.0
            assert answers.verify(r, f"{a} {op} {b} = {r['answer']}") == 0.0  # the bare answer
    assert not seen["train"] & (seen["validation"] | seen["test"])
    assert not seen["validation"] & seen["test"]
