"""Hallucination rate = E[1 − V(claim)], swept over decoding settings, with and without RAG.

A verifier V maps a generated claim to [0, 1] (1 = supported). The rate is the mean of 1 − V over
questions and samples. Sampling more freely (higher temperature, larger top-p) usually raises it;
retrieval usually lowers it, because the answer can be copied from the context. `sweep` measures
every (temperature, top-p) cell of a grid, once closed-book and once with a RAG prompt.

Data: JSONL rows {"question": str, "answer": str or "answers": [str, ...]}.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import ConfigError, DataError
from lmforge.eval.prompts import qa_prompt
from lmforge.fileio import read_rows

Verifier = Callable[[str, dict], float]  # (claim, row) -> V in [0, 1]
STOP = ["\nQuestion:", "\n\n"]  # an answer ends where a next question or paragraph would begin


def _norm(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


class ContainsAnswer:
    """V = 1 when any reference answer appears in the claim (case and punctuation ignored)."""

    def __call__(self, claim: str, row: dict) -> float:
        refs = row.get("answers") or [row["answer"]]
        text = f" {_norm(claim)} "
        return float(any(f" {_norm(r)} " in text for r in refs if _norm(r)))


def hallucination_rate(verdicts: Sequence[float]) -> float:
    """Mean of 1 − V over verdicts V in [0, 1]."""
    if not verdicts:
        raise ConfigError("no verdicts to average")
    if any(not 0.0 <= v <= 1.0 for v in verdicts):
        raise ConfigError("verifier scores must lie in [0, 1]")
    return sum(1.0 - v for v in verdicts) / len(verdicts)


@dataclass(frozen=True)
class DecodingSetting:
    temperature: float
    top_p: float = 1.0

    @property
    def label(self) -> str:
        return f"T={self.temperature:g}, top-p={self.top_p:g}"


def decoding_grid(
    temperatures: Sequence[float] = (0.0, 0.7, 1.0), top_ps: Sequence[float] = (1.0, 0.9)
) -> list[DecodingSetting]:
    """Every (temperature, top-p) pair; greedy (T=0) appears once since top-p cannot change it."""
    pairs = ((t, p if t > 0 else 1.0) for t, p in itertools.product(temperatures, top_ps))
    return [DecodingSetting(t, p) for t, p in dict.fromkeys(pairs)]


def _qa_row(row: dict, where: str) -> dict:
    if not isinstance(row.get("question"), str):
        raise DataError(f"{where}: expected a 'question' string")
    if not (isinstance(row.get("answer"), str) or isinstance(row.get("answers"), list)):
        raise DataError(f"{where}: expected 'answer' (string) or 'answers' (list)")
    return row


def load_qa(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows {question, answer or answers} from a local JSONL file."""
    return read_rows(path, _qa_row, limit)


@dataclass
class SweepRow:
    setting: str
    temperature: float
    top_p: float
    rag: bool
    rate: float
    n: int


def sweep(
    lm,
    rows: list[dict],
    verifier: Verifier | None = None,
    settings: Sequence[DecodingSetting] | None = None,
    rag=None,
    samples: int = 1,
    max_new_tokens: int = 48,
    seed: int = 0,
    progress: bool = False,
) -> list[SweepRow]:
    """The hallucination rate for each decoding setting, closed-book and (given a RAG) with RAG.

    With RAG the prompt is the one `RAG` builds: retrieved chunks before the question, fitted to
    the context window. Each question is answered `samples` times per setting.
    """
    from lmforge.eval.scoring import generate_texts

    verifier = verifier or ContainsAnswer()
    settings = list(settings or decoding_grid())
    prompt_sets = {False: [qa_prompt(r["question"]) for r in rows]}
    if rag is not None:
        if not hasattr(rag.answerer, "build_prompt"):
            raise ConfigError("RAG for a hallucination sweep needs an LM (RAG(retriever, lm))")
        prompt_sets[True] = [
            rag.answerer.build_prompt(r["question"], rag.retrieve(r["question"]))[0] for r in rows
        ]
    out = []
    for with_rag, prompts in prompt_sets.items():
        for s in settings:
            n = samples if s.temperature > 0 else 1  # greedy gives the same answer every time
            repeated = [p for p in prompts for _ in range(n)]
            top_p = s.top_p if s.top_p < 1.0 else None
            options = dict(temperature=s.temperature, top_p=top_p, seed=seed, progress=progress)
            claims = generate_texts(lm, repeated, max_new_tokens, STOP, **options)
            verdicts = [verifier(c, rows[i // n]) for i, c in enumerate(claims)]
            rate = hallucination_rate(verdicts)
            out.append(SweepRow(s.label, s.temperature, s.top_p, with_rag, rate, len(verdicts)))
    return out
