"""ChatCORE-style evaluation of a chat model (nanochat's chat_eval): ARC-Easy, ARC-Challenge, GSM8K.

- ARC (categorical): the question and its choices go in one user message, each choice followed
  by its letter ("- choice=A"), then "Respond only with the letter of the correct answer."; the
  conversation is rendered by the model's chat template with the assistant turn opened, and the
  answer is the letter whose token gets the highest logit at the last prompt position (only the
  item's letters compete, so no text is generated and nothing is parsed).
- GSM8K (generative): the question as the user message, a greedy reply sampled through the
  inference Engine, the final number extracted (`#### n`, else "the answer is n", else the last
  number) and compared with the reference: pass@1.

Each accuracy is centered on its random baseline (ARC 25%, GSM8K 0%) and ChatCORE is their mean.
Rows are taken in file order (the first --max-per-task), the ARC files being CORE's copies of
the ARC test splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from lmforge.data.batches import pad_collate
from lmforge.errors import ConfigError, DataError
from lmforge.eval.core import (
    TASKS_BY_LABEL,
    CoreResult,
    check_max_per_task,
    load_task_rows,
    task_names,
)
from lmforge.eval.core_scoring import lm_head
from lmforge.eval.multiple_choice import LETTERS
from lmforge.infer.engine import Engine, GenerationParams
from lmforge.model.modes import eval_mode
from lmforge.tasks.answers import exact_match, extract_numeric_answer
from lmforge.tasks.gsm8k import load_gsm8k

BASELINES = {"ARC-Easy": 25, "ARC-Challenge": 25, "GSM8K": 0}  # percent, as CORE's
CHAT_TASKS = tuple(BASELINES)
ARC_FILES = {"ARC-Easy": "arc_easy", "ARC-Challenge": "arc_challenge"}


def select_chat_tasks(names: str | Sequence[str] | None) -> list[str]:
    """Task names (comma-separated or a list; case-insensitive); None = all three."""
    return task_names(names, CHAT_TASKS, str.lower)


def multiple_choice_message(question: str, choices: Sequence[str]) -> str:
    """The user message for a lettered question: each choice, then '=' and its letter with no
    space (the reply is the bare letter, so the prompt shows the very same token)."""
    lines = [f"Multiple Choice question: {question}\n"]
    lines += [f"- {choice}={letter}\n" for letter, choice in zip(LETTERS, choices)]
    lines.append("\nRespond only with the letter of the correct answer.")
    return "".join(lines)


def load_arc(folder: str | Path, name: str, limit: int | None = None) -> list[dict]:
    """Rows {question, choices, gold} from CORE's ARC file (its 'Question: ' prefix removed)."""
    rows = load_task_rows(folder, TASKS_BY_LABEL[ARC_FILES[name]])
    out = []
    for row in rows[:limit]:
        if len(row["choices"]) > len(LETTERS):
            raise DataError(f"{name}: more than {len(LETTERS)} choices in {row['query'][:40]!r}")
        question = row["query"].strip().removeprefix("Question:").strip()
        out.append({"question": question, "choices": row["choices"], "gold": row["gold"]})
    return out


def _chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-message conversation with the assistant turn opened (the same rendering
    `lmforge chat` and the server use)."""
    from lmforge.interop.chat_template import render_chat

    messages = [{"role": "user", "content": text}]
    return tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt=True))


def letter_ids(tokenizer, n: int) -> list[int]:
    """Token ids of the letters A.. as a bare reply; each must be one distinct token."""
    ids = []
    for letter in LETTERS[:n]:
        encoded = tokenizer.encode(letter)
        if len(encoded) != 1:
            raise ConfigError(f"letter {letter!r} is {len(encoded)} tokens; ARC needs one each")
        ids.append(encoded[0])
    return ids


@torch.inference_mode()
def evaluate_arc(lm, rows: list[dict], batch_size: int = 16) -> float:
    """Accuracy: the highest-logit letter among each item's letters at the last prompt position."""
    model, tok = lm.model, lm.tokenizer
    max_len = lm.config.max_seq_len
    device = next(model.parameters()).device
    prompts = [
        _chat_ids(tok, multiple_choice_message(r["question"], r["choices"]))[-max_len:]
        for r in rows
    ]
    letters = {n: letter_ids(tok, n) for n in {len(r["choices"]) for r in rows}}
    correct = 0
    with eval_mode(model):
        for lo in range(0, len(rows), batch_size):
            batch = prompts[lo : lo + batch_size]
            ids, mask = pad_collate(batch, 0)  # right padding: never seen by real tokens
            last = (torch.arange(len(batch)), mask.sum(1) - 1)  # each prompt's last position
            logits = lm_head(model, model.hidden_states(ids.to(device))[last]).float()
            for i, row in enumerate(rows[lo : lo + batch_size]):
                focus = logits[i, letters[len(row["choices"])]]
                correct += int(focus.argmax().item()) == row["gold"]
    return correct / len(rows)


def gsm8k_replies(
    lm, rows: list[dict], max_new_tokens: int = 512, batch_size: int = 16
) -> list[str]:
    """Greedy chat replies to each question, generated by the Engine (continuous batching),
    stopping at EOS or the chat template's end-of-turn token as `lmforge chat` does."""
    tok = lm.tokenizer
    engine = Engine.from_lm(lm, max_batch=batch_size)
    params = GenerationParams(
        max_new_tokens, temperature=0.0, stop_token_ids=tok.chat_stop_ids(engine.eos_ids)
    )
    keep = engine.max_len - 1  # the engine needs room for at least one new token
    prompts = [_chat_ids(tok, r["question"])[-keep:] for r in rows]
    return [c.text for c in engine.generate(prompts, params)]


def score_gsm8k(replies: Sequence[str], rows: Sequence[dict]) -> float:
    """pass@1: the share of replies whose final number equals the reference."""
    hits = [exact_match(extract_numeric_answer(t), r["reference"]) for t, r in zip(replies, rows)]
    return sum(hits) / len(rows)


class ChatResult(CoreResult):
    """Per-task accuracies as CORE keeps them; their mean centered accuracy is ChatCORE."""

    chatcore = CoreResult.core

    def to_json(self) -> dict:
        return {"results": self.results, "centered": self.centered, "chatcore": self.chatcore}


def load_chat_data(
    tasks: Sequence[str], core_dir: str | Path, gsm8k: str | Path, max_per_task: int | None
) -> dict[str, list[dict]]:
    """Every task's rows, read and checked before any model work."""
    check_max_per_task(max_per_task)
    return {
        name: load_gsm8k(gsm8k, max_per_task)
        if name == "GSM8K"
        else load_arc(core_dir, name, max_per_task)
        for name in tasks
    }


def evaluate_chat(
    lm,
    data: dict[str, list[dict]],
    max_new_tokens: int = 512,
    batch_size: int = 16,
    progress: bool = False,
) -> ChatResult:
    """Accuracy and centered accuracy per task (rows from load_chat_data)."""
    lm.require_tokenizer("chat evaluation")
    result = ChatResult()
    for name, rows in data.items():
        if name == "GSM8K":
            acc = score_gsm8k(gsm8k_replies(lm, rows, max_new_tokens, batch_size), rows)
        else:
            acc = evaluate_arc(lm, rows, batch_size)
        log = f"{name:14} {len(rows):5} items" if progress else ""
        result.add(name, acc, BASELINES[name], len(rows), log)
    return result
