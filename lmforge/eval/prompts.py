"""Prompt builders for in-context learning (zero/one/few-shot) and chain-of-thought.

In-context learning shows the model solved examples before the query, in one fixed format, so
the continuation it finds most likely is the answer in that format:

    Input: 2
    Output: 4
    ...
    Input: 7
    Output:

Chain-of-thought asks for the reasoning before the answer ("Let's think step by step."), and
few-shot CoT shows worked rationales. PROMPT_STYLES names the five styles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lmforge.errors import ConfigError, require_choice

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


# In-context learning fixtures (Brown et al. 2020): the query and the answer a model that
# learned the pattern should give.
SQUARES = ([Example("2", "4"), Example("3", "9"), Example("5", "25")], "7", "49")
ADDITION = ([Example("2+3", "5"), Example("10+4", "14"), Example("6+7", "13")], "17+25", "42")
LINEAR = ([Example("f(2)", "5"), Example("f(3)", "7"), Example("f(4)", "9")], "f(10)", "21")


# style -> (shots, chain of thought); shots None = every example given
PROMPT_STYLES = {
    "zero-shot": (0, False),
    "one-shot": (1, False),
    "few-shot": (None, False),
    "cot": (0, True),
    "few-shot-cot": (None, True),
}


def build_prompt(
    style: str,
    query: str,
    examples: Sequence[Example] = (),
    instruction: str = "",
    template: Template | None = None,
) -> str:
    """The prompt for `query` in one of PROMPT_STYLES: the instruction (if any), the first
    `shots` examples, then the query. Chain of thought shows each example's rationale after the
    trigger and ends the query with the trigger; its default template is Q:/A:."""
    require_choice("prompt style", style, PROMPT_STYLES)
    shots, cot = PROMPT_STYLES[style]
    template = template or (QA if cot else Template())
    shots = len(examples) if shots is None else shots
    if shots > len(examples):
        raise ConfigError(f"{shots}-shot prompt needs {shots} examples, got {len(examples)}")
    parts = []
    for ex in examples[:shots]:
        if cot:
            reasoning = f"{COT_TRIGGER} {ex.rationale}".strip() if ex.rationale else COT_TRIGGER
            ex = Example(ex.input, f"{reasoning} The answer is {ex.output}.")
        parts.append(template.example(ex))
    parts.append(f"{template.query(query)} {COT_TRIGGER}" if cot else template.query(query))
    head = f"{instruction.strip()}{template.separator}" if instruction.strip() else ""
    return head + template.separator.join(parts)
