"""Exact-match generation tasks: GSM8K prompts and scoring.

A verifiable task is scored by pulling the final answer out of free text and comparing it
exactly with the reference; extraction, normalisation and the GSM8K loader live in
`lmforge.tasks` (shared with post-training).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmforge.errors import DataError
from lmforge.eval.prompts import COT_TRIGGER, qa_prompt
from lmforge.tasks.answers import exact_match, extract_numeric_answer


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


# ---- GSM8K -----------------------------------------------------------------------------------
def gsm8k_prompt(question: str, shots: list[dict] = (), cot: bool = False) -> str:
    """Few-shot prompt: solved examples (full solutions with CoT, else only '#### n'), then Q."""
    parts = []
    for ex in shots:
        solution = f"{COT_TRIGGER} {ex['answer'].strip()}" if cot else f"#### {ex['reference']}"
        parts.append(f"{qa_prompt(ex['question'])} {solution}")
    parts.append(f"{qa_prompt(question)} {COT_TRIGGER}" if cot else qa_prompt(question))
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
    correct, n = sum(s["ok"] for s in samples), len(samples)
    settings = {"shots": shots, "cot": cot, "max_new_tokens": max_new_tokens}
    return TaskResult("gsm8k", correct / n, correct, n, settings, samples)
