"""Exact-match generation tasks: answer extraction, scoring, and GSM8K.

A verifiable task is scored by pulling the final answer out of free text and comparing it
exactly with the reference: GSM8K solutions end in "#### 72"; a model may instead write "The
answer is 72." or just end on a number; a multiple-choice answer is a letter. Numbers are
normalised first ("1,000" = "1000", "3.50" = "3.5", "$5" = "5") so formatting is not an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lmforge.errors import DataError
from lmforge.eval.prompts import COT_TRIGGER
from lmforge.fileio import read_jsonl

_NUMBER = r"-?\$?\s?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_RE = re.compile(r"####\s*(" + _NUMBER + r")")
_ANSWER_IS_RE = re.compile(r"answer is\s*:?\s*(" + _NUMBER + r")", re.IGNORECASE)


def normalize_number(text: str) -> str:
    """Canonical form of a number: no $, commas or spaces, no trailing zeros after a point."""
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s == "-0" else s


def extract_gsm8k(text: str) -> str | None:
    """The number after the last '####' (GSM8K's reference format), normalised."""
    found = _GSM8K_RE.findall(text)
    return normalize_number(found[-1]) if found else None


def extract_last_number(text: str) -> str | None:
    """The last number in the text, normalised."""
    found = _NUMBER_RE.findall(text)
    return normalize_number(found[-1]) if found else None


def extract_numeric_answer(text: str) -> str | None:
    """A model's numeric answer: '#### n', else 'the answer is n', else the last number."""
    if (n := extract_gsm8k(text)) is not None:
        return n
    found = _ANSWER_IS_RE.findall(text)
    return normalize_number(found[-1]) if found else extract_last_number(text)


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


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "gsm8k": extract_gsm8k,
    "number": extract_numeric_answer,
    "last_number": extract_last_number,
    "choice": extract_choice,
}


def exact_match(prediction: str | None, reference: str) -> bool:
    """Equal after number normalisation (a missing prediction is wrong)."""
    if prediction is None:
        return False
    return normalize_number(prediction) == normalize_number(reference)


@dataclass
class TaskResult:
    task: str
    accuracy: float
    correct: int
    total: int
    settings: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)  # question, completion, extracted, ref

    def __str__(self) -> str:
        return f"{self.task}: accuracy {self.accuracy:.4f} ({self.correct}/{self.total})"

    def to_dict(self) -> dict:
        return asdict(self)


# ---- GSM8K -----------------------------------------------------------------------------------
def load_gsm8k(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows {question, answer, reference} from a GSM8K JSONL file (reference = the #### number)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"GSM8K data not found: {path}")
    rows = []
    for lineno, row in read_jsonl(path):
        if not {"question", "answer"} <= row.keys():
            raise DataError(f"{path}:{lineno}: expected fields 'question' and 'answer'")
        ref = extract_gsm8k(row["answer"])
        if ref is None:
            raise DataError(f"{path}:{lineno}: answer has no '#### <number>' line")
        rows.append({**row, "reference": ref})
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise DataError(f"{path}: no GSM8K rows")
    return rows


def gsm8k_prompt(question: str, shots: list[dict] = (), cot: bool = False) -> str:
    """Few-shot prompt: solved examples (full solutions with CoT, else only '#### n'), then Q."""
    parts = []
    for ex in shots:
        solution = ex["answer"].strip() if cot else f"#### {ex['reference']}"
        if cot:
            solution = f"{COT_TRIGGER} {solution}"
        parts.append(f"Question: {ex['question'].strip()}\nAnswer: {solution}")
    query = f"Question: {question.strip()}\nAnswer:"
    parts.append(f"{query} {COT_TRIGGER}" if cot else query)
    return "\n\n".join(parts)


def evaluate_gsm8k(
    lm,
    rows: list[dict],
    shots: int = 0,
    cot: bool = False,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    progress: bool = False,
) -> TaskResult:
    """Greedy-decode each question; correct when the extracted number equals the reference.

    The first `shots` rows are the in-context examples and are not scored.
    """
    from lmforge.eval.scoring import generate_texts

    examples, scored = rows[:shots], rows[shots:]
    if not scored:
        raise DataError(f"no rows left to score after taking {shots} as examples")
    prompts = [gsm8k_prompt(r["question"], examples, cot) for r in scored]
    outs = generate_texts(
        lm, prompts, max_new_tokens, ["\n\nQuestion:"], batch_size, progress, temperature=0.0
    )
    samples = []
    for r, out in zip(scored, outs):
        pred = extract_numeric_answer(out)
        ok = exact_match(pred, r["reference"])
        samples.append({"question": r["question"], "completion": out, "pred": pred, "ok": ok})
    correct = sum(s["ok"] for s in samples)
    return TaskResult(
        "gsm8k",
        correct / len(samples),
        correct,
        len(samples),
        {"shots": shots, "cot": cot, "max_new_tokens": max_new_tokens},
        samples,
    )
