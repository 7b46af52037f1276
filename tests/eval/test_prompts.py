"""ICL and chain-of-thought prompt builders on worked fixtures."""

import re

import pytest

from lmforge.errors import ConfigError
from lmforge.eval.prompts import (
    ADDITION,
    COT_TRIGGER,
    LINEAR,
    SQUARES,
    Example,
    build_prompt,
)
from lmforge.eval.tasks import extract_numeric_answer


def test_zero_one_few_shot_squares():
    examples, query, _ = SQUARES
    assert build_prompt("zero-shot", query, examples) == "Input: 7\nOutput:"
    assert build_prompt("one-shot", query, examples) == "Input: 2\nOutput: 4\n\nInput: 7\nOutput:"
    assert build_prompt("few-shot", query, examples, instruction="Square the number.") == (
        "Square the number.\n\n"
        "Input: 2\nOutput: 4\n\nInput: 3\nOutput: 9\n\nInput: 5\nOutput: 25\n\nInput: 7\nOutput:"
    )


def _solve_from_prompt(prompt: str) -> str:
    """A stand-in 'model' that reads the shots back out of the prompt and fits the pattern:
    it can only answer if the prompt carries every example in the right format."""
    pairs = re.findall(r"Input: (.+)\nOutput: (\S+)", prompt)
    query = re.findall(r"Input: (.+)\nOutput:$", prompt)[0]
    xs = [int(re.sub(r"\D", "", x)) for x, _ in pairs]
    ys = [int(y) for _, y in pairs]
    if "+" in query:
        return str(sum(int(t) for t in query.split("+")))
    q = int(re.sub(r"\D", "", query))
    if all(y == x * x for x, y in zip(xs, ys)):
        return str(q * q)
    slope = (ys[1] - ys[0]) // (xs[1] - xs[0])  # f(x) = a x + b from two points
    assert all(y == slope * x + ys[0] - slope * xs[0] for x, y in zip(xs, ys))
    return str(slope * q + ys[0] - slope * xs[0])


@pytest.mark.parametrize("fixture", [SQUARES, ADDITION, LINEAR], ids=["7->49", "17+25", "f(10)"])
def test_spec_fixtures(fixture):
    examples, query, answer = fixture
    prompt = build_prompt("few-shot", query, examples)
    assert prompt.endswith(f"Input: {query}\nOutput:")
    assert _solve_from_prompt(prompt) == answer
    assert extract_numeric_answer(f"{prompt} {answer}\n") == answer


def test_linear_fixture_prompt_text():
    examples, query, _ = LINEAR
    assert build_prompt("few-shot", query, examples) == (
        "Input: f(2)\nOutput: 5\n\nInput: f(3)\nOutput: 7\n\nInput: f(4)\nOutput: 9\n\n"
        "Input: f(10)\nOutput:"
    )


def test_chain_of_thought_zero_and_few_shot():
    assert build_prompt("cot", "What is 17+25?") == f"Q: What is 17+25?\nA: {COT_TRIGGER}"
    shots = [Example("What is 2+3?", "5", "2 plus 3 is 5.")]
    assert build_prompt("few-shot-cot", "What is 17+25?", shots) == (
        f"Q: What is 2+3?\nA: {COT_TRIGGER} 2 plus 3 is 5. The answer is 5.\n\n"
        f"Q: What is 17+25?\nA: {COT_TRIGGER}"
    )
    completion = " 17 plus 25: 17+20=37, 37+5=42. The answer is 42."
    assert extract_numeric_answer(completion) == "42"


def test_bad_styles_and_shot_counts():
    with pytest.raises(ConfigError, match="prompt style"):
        build_prompt("two-shot", "x")
    with pytest.raises(ConfigError, match="needs 1 examples"):
        build_prompt("one-shot", "x", [])
