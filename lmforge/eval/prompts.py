"""Prompt builders for in-context learning (zero/one/few-shot) and chain-of-thought.

In-context learning shows the model solved examples before the query, in one fixed format, so
the continuation it finds most likely is the answer in that format:

    Input: 2
    Output: 4
    ...
    Input: 7
    Output:

Chain-of-thought asks for the reasoning before the answer ("Let's think step by step."), and
few-shot CoT shows worked rationales. Each style is a small class in PROMPT_STYLES.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmforge.errors import ConfigError

COT_TRIGGER = "Let's think step by step."


@dataclass(frozen=True)
class Example:
    input: str
    output: str
    rationale: str = ""  # worked reasoning, shown by few-shot chain-of-thought


@dataclass(frozen=True)
class Template:
    """How one example is written; the query is written the same way with the output left open."""

    input_prefix: str = "Input: "
    output_prefix: str = "Output:"
    separator: str = "\n\n"

    def example(self, ex: Example) -> str:
        return f"{self.input_prefix}{ex.input}\n{self.output_prefix} {ex.output}"

    def query(self, text: str) -> str:
        return f"{self.input_prefix}{text}\n{self.output_prefix}"


QA = Template("Q: ", "A:")


def qa_prompt(question: str) -> str:
    """The plain "Question: ...\nAnswer:" prompt of the GSM8K, multiple-choice and QA tasks."""
    return f"Question: {question.strip()}\nAnswer:"


# SPEC §12 fixtures: the query and the answer a model that learned the pattern should give.
SQUARES = ([Example("2", "4"), Example("3", "9"), Example("5", "25")], "7", "49")
ADDITION = ([Example("2+3", "5"), Example("10+4", "14"), Example("6+7", "13")], "17+25", "42")
LINEAR = (
    [Example("f(2)", "5"), Example("f(3)", "7"), Example("f(4)", "9")],
    "f(10)",
    "21",
)
FIXTURES = {"squares": SQUARES, "addition": ADDITION, "linear": LINEAR}


def _join(parts: Sequence[str], separator: str, instruction: str) -> str:
    head = f"{instruction.strip()}{separator}" if instruction.strip() else ""
    return head + separator.join(parts)


class ICLPrompt:
    """Zero-, one- or few-shot: the first `shots` examples, then the query."""

    def __init__(self, shots: int | None = None):
        self.shots = shots

    def build(
        self, query: str, examples: Sequence[Example] = (), instruction: str = "", template=None
    ) -> str:
        template = template or Template()
        shots = len(examples) if self.shots is None else self.shots
        if shots < 0:
            raise ConfigError(f"shots must be >= 0, got {shots}")
        if shots > len(examples):
            raise ConfigError(f"{shots}-shot prompt needs {shots} examples, got {len(examples)}")
        parts = [template.example(ex) for ex in examples[:shots]] + [template.query(query)]
        return _join(parts, template.separator, instruction)


class CoTPrompt:
    """Chain-of-thought: worked rationales (if any) and the trigger after the query."""

    def __init__(self, shots: int | None = None, trigger: str = COT_TRIGGER):
        self.shots, self.trigger = shots, trigger

    def build(
        self, query: str, examples: Sequence[Example] = (), instruction: str = "", template=None
    ) -> str:
        template = template or QA
        shots = len(examples) if self.shots is None else self.shots
        if shots > len(examples):
            raise ConfigError(f"{shots}-shot prompt needs {shots} examples, got {len(examples)}")
        parts = []
        for ex in examples[:shots]:
            reasoning = f"{self.trigger} {ex.rationale}".strip() if ex.rationale else self.trigger
            body = f"{reasoning} The answer is {ex.output}."
            parts.append(f"{template.input_prefix}{ex.input}\n{template.output_prefix} {body}")
        parts.append(f"{template.query(query)} {self.trigger}")
        return _join(parts, template.separator, instruction)


PROMPT_STYLES = {
    "zero-shot": lambda: ICLPrompt(0),
    "one-shot": lambda: ICLPrompt(1),
    "few-shot": lambda: ICLPrompt(None),
    "cot": lambda: CoTPrompt(0),
    "few-shot-cot": lambda: CoTPrompt(None),
}


def build_prompt(
    style: str,
    query: str,
    examples: Sequence[Example] = (),
    instruction: str = "",
    template: Template | None = None,
) -> str:
    """The prompt for `query` in one of PROMPT_STYLES."""
    if style not in PROMPT_STYLES:
        raise ConfigError(f"prompt style {style!r}: expected one of {sorted(PROMPT_STYLES)}")
    return PROMPT_STYLES[style]().build(query, examples, instruction, template)
