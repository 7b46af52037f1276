"""Multiple choice by log-likelihood: the model's answer is the choice it finds most probable.

Each choice is scored as a continuation of the question, log P(" choice" | prompt), so no text
is generated and nothing needs parsing. `acc` takes the highest sum of log-probs; `acc_norm`
divides by the choice's length in characters first, which removes the bias toward short
choices (lm-evaluation-harness reports both the same way).

Data: JSONL rows {"question": str, "choices": [str, ...], "answer": index or letter}.
"""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import DataError
from lmforge.eval.prompts import qa_prompt
from lmforge.eval.tasks import TaskResult
from lmforge.fileio import read_rows

LETTERS = "ABCDEFGHIJ"


def _answer_index(value, n: int, where: str) -> int:
    if isinstance(value, str) and len(value) == 1 and value.upper() in LETTERS[:n]:
        return LETTERS.index(value.upper())
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n:
        return value
    raise DataError(
        f"{where}: 'answer' must be a choice index 0..{n - 1} or a letter, got {value!r}"
    )


def _choice_row(row: dict, where: str) -> dict:
    choices = row.get("choices")
    if not isinstance(row.get("question"), str) or not isinstance(choices, list):
        raise DataError(f"{where}: expected 'question' (string) and 'choices' (list)")
    if len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise DataError(f"{where}: 'choices' must hold at least 2 non-empty strings")
    return {**row, "answer": _answer_index(row.get("answer"), len(choices), where)}


def load_choices(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows {question, choices, answer (int index)} from a local JSONL file."""
    return read_rows(path, _choice_row, limit)


def evaluate_choices(lm, rows: list[dict], batch_size: int = 16, progress: bool = False):
    """(acc result, acc_norm result) over `rows`."""
    from lmforge.eval.scoring import loglikelihood

    pairs = [(qa_prompt(r["question"]), f" {c}") for r in rows for c in r["choices"]]
    scores = iter(loglikelihood(lm, pairs, batch_size, progress))
    correct = correct_norm = 0
    samples = []
    for r in rows:
        lps = [next(scores)[0] for _ in r["choices"]]
        norm = [lp / len(c) for lp, c in zip(lps, r["choices"])]
        pick = max(range(len(lps)), key=lps.__getitem__)
        pick_norm = max(range(len(norm)), key=norm.__getitem__)
        correct += pick == r["answer"]
        correct_norm += pick_norm == r["answer"]
        samples.append({"question": r["question"], "logprobs": lps, "pred": pick})
    n = len(rows)
    acc = TaskResult("choice/acc", correct / n, correct, n, {}, samples)
    return acc, TaskResult("choice/acc_norm", correct_norm / n, correct_norm, n)
