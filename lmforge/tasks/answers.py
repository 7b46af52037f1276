"""Answers pulled out of free text and compared exactly: the one answer normaliser and exact match
that post-training rewards (`verify`), the built-in tasks and GSM8K evaluation share.

A model may end a GSM8K solution on "#### 72", write "The answer is 72." or just end on a number;
a multiple-choice answer is a letter. Numbers are canonicalised before comparing ("1,000" = "1000",
"3.50" = "3.5", "$5" = "5", "+7" = "7"), so formatting is not an error; any other answer is
compared as trimmed text without a trailing period (case matters).
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from lmforge.errors import DataError

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_RE = re.compile(r"####\s*(" + _NUMBER + r")")
_ANSWER_IS_RE = re.compile(r"answer is\s*:?\s*(" + _NUMBER + r")", re.IGNORECASE)
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


def canonical_answer(text: str) -> str:
    """Canonical form of an answer: a number without $, commas, spaces, a leading +, leading
    zeros or trailing fractional zeros ("-0" is "0"); any other text trimmed, trailing period off.
    Decimal arithmetic, so long integers compare exactly (a float would round them)."""
    text = text.strip().rstrip(".").strip()
    plain = text.replace(",", "").replace("$", "").replace(" ", "").lstrip("+")
    if not _PLAIN_NUMBER.fullmatch(plain):
        return text
    value = Decimal(plain)  # a plain number always parses
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def exact_match(prediction: str | None, reference: str) -> bool:
    """Whether two answers are equal after `canonical_answer` (a missing prediction is wrong)."""
    if prediction is None:
        return False
    return canonical_answer(prediction) == canonical_answer(str(reference))


def _last(pattern: re.Pattern, text: str) -> str | None:
    """The number of the last match of `pattern` in the text, normalised."""
    found = pattern.findall(text)
    return canonical_answer(found[-1]) if found else None


def extract_gsm8k(text: str) -> str | None:
    """The number after the last '####' (GSM8K's reference format), normalised."""
    return _last(_GSM8K_RE, text)


def extract_last_number(text: str) -> str | None:
    """The last number in the text, normalised."""
    return _last(_NUMBER_RE, text)


def extract_numeric_answer(text: str) -> str | None:
    """A model's numeric answer: '#### n', else 'the answer is n', else the last number."""
    answers = (_last(pattern, text) for pattern in (_GSM8K_RE, _ANSWER_IS_RE, _NUMBER_RE))
    return next((n for n in answers if n is not None), None)


def extract_choice(text: str, n_choices: int = 4) -> str | None:
    """A multiple-choice letter: 'answer is (B)', else '(B)', else a standalone leading 'B'."""
    letters = "ABCDEFGHIJ"[:n_choices]
    for pattern in (
        rf"answer is\s*:?\s*\(?([{letters}])\b",
        rf"\(([{letters}])\)",
        rf"^\s*([{letters}])(?:[.):,\s]|$)",
        rf"\b([{letters}])\b",
    ):
        m = re.search(pattern, text, re.IGNORECASE if pattern.startswith("answer") else 0)
        if m:
            return m.group(1).upper()
    return None


def extract_answer(completion: str) -> str:
    """The answer part of a trained model's completion: after the last `####` if present, else
    its first line (the built-in tasks answer on one line)."""
    if "####" in completion:
        completion = completion.rsplit("####", 1)[1]
    return completion.strip().split("\n", 1)[0].strip()


def verify(record: dict[str, Any], completion: str) -> float:
    """The verifier reward: 1.0 when the completion's answer equals the record's "answer"."""
    if "answer" not in record:
        raise DataError(f"verify: the record has no 'answer' field ({sorted(record)})")
    return float(exact_match(extract_answer(completion), record["answer"]))
