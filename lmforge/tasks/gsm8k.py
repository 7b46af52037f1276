"""GSM8K (grade-school math word problems): the one loader, used by evaluation and post-training.

A row is {"question", "answer"} where the answer is a worked solution ending in "#### <number>".
"""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import DataError
from lmforge.fileio import read_rows
from lmforge.tasks.answers import extract_gsm8k


def gsm8k_answer(solution: str) -> str:
    """The reference number of a GSM8K solution (after its last `####`, normalised)."""
    ref = extract_gsm8k(solution)
    if ref is None:
        raise DataError("GSM8K answer has no '#### <number>' line")
    return ref


def _gsm8k_row(row: dict, where: str) -> dict:
    if not {"question", "answer"} <= row.keys():
        raise DataError(f"{where}: expected fields 'question' and 'answer'")
    ref = extract_gsm8k(row["answer"])
    if ref is None:
        raise DataError(f"{where}: answer has no '#### <number>' line")
    return {**row, "reference": ref}


def load_gsm8k(path: str | Path, limit: int | None = None) -> list[dict]:
    """Rows {question, answer, reference} from a GSM8K JSONL file: `answer` is the worked
    solution, `reference` the normalised number after its '####'."""
    if not Path(path).is_file():
        raise DataError(f"GSM8K data not found: {path}")
    return read_rows(path, _gsm8k_row, limit)
