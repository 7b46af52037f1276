"""Anthropic HH-RLHF preference data: `\\n\\nHuman: ... \\n\\nAssistant: ...` dialogues as
prompt / chosen / rejected records, or as role/content messages."""

from __future__ import annotations

import os
import re
from pathlib import Path

from lmforge.errors import DataError
from lmforge.fileio import read_rows
from lmforge.tasks.synthetic import Record

ASSISTANT = "\n\nAssistant:"  # where the prompt of an HH pair ends


def parse_hh(chosen: str, rejected: str) -> Record:
    """Split an HH pair into the shared prompt (their common prefix, cut after its last
    `\\n\\nAssistant:`) and the two replies. A few real pairs diverge before the final turn;
    the replies then hold the rest of each dialogue."""
    common = len(os.path.commonprefix([chosen, rejected]))
    cut = chosen.rfind(ASSISTANT, 0, common)  # the whole marker lies inside the shared prefix
    if cut < 0:
        raise DataError("HH chosen and rejected dialogues share no '\\n\\nAssistant:' prompt")
    end = cut + len(ASSISTANT)
    return {"prompt": chosen[:end], "chosen": chosen[end:], "rejected": rejected[end:]}


def hh_messages(dialogue: str) -> list[dict[str, str]]:
    """An HH dialogue as role/content messages (user/assistant)."""
    parts = re.split(r"\n\n(Human|Assistant):", dialogue)
    return [
        {"role": "user" if role == "Human" else "assistant", "content": content.strip()}
        for role, content in zip(parts[1::2], parts[2::2])
    ]


def _hh_row(row: dict, where: str) -> Record:
    try:
        return parse_hh(row["chosen"], row["rejected"])
    except (KeyError, DataError) as err:
        raise DataError(f"{where}: {err}") from err


def load_hh(path: str | Path, limit: int | None = None) -> list[Record]:
    """HH-RLHF JSONL (.gz or plain) {"chosen", "rejected"} -> {"prompt", "chosen", "rejected"}."""
    return read_rows(path, _hh_row, limit)
