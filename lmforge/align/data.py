"""Post-training data: SFT records and preference triples -> token ids with response-only labels.

Accepted records (JSONL lines or dicts):
  SFT         {"prompt", "response"} (aliases: question/instruction, completion/answer/output),
              {"messages": [{"role", "content"}, ...]}, or a message-list prompt + response.
  preference  {"prompt", "chosen", "rejected"} as strings or message lists (TRL's formats), or
              the HH form {"chosen", "rejected"} of whole `\\n\\nHuman:/\\n\\nAssistant:` dialogues.
  unpaired    (KTO) an SFT record with "label": true|false, or a preference pair split in two.
Message lists are rendered by `lmforge.interop.chat_template.render_chat` (the tokenizer's chat
template as transformers renders it, else a built-in one of the role tokens:
`<|user|>hi<|end|><|assistant|>yo<|end|>`).

A source is a JSONL file, a list of dicts, a built-in `task:NAME[:LEVEL][:SPLIT][:chat]` (its
split by a prompt hash too, see lmforge/tasks/synthetic.py), or
`file:PATH[:train|validation|test][:chat]`: the first n records of one split of a JSONL file,
drawn by a hash of each record's prompt (test 10%, validation 10%, train the rest; so a prompt
and its duplicates never cross splits), `:chat` making a string prompt one user message.

A record becomes segments of (text, trainable); every assistant reply is trainable, and the model
learns to stop on EOS: appended (and trained on) unless the template already ended the reply with
it, as ChatML's `<|im_end|>` does — then nothing is appended and the formatting after that final
end token (ChatML's newline) is dropped, so a sequence never ends in two end tokens. Labels are
HF-style and unshifted: a copy of input_ids with prompt positions set to -100 (see
logprobs.sft_loss). Bad records — missing fields, empty responses, prompts that do not fit the
context — raise DataError naming file:line, or are skipped and counted when `skip_invalid=True`.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmforge.align.logprobs import IGNORE
from lmforge.data.batches import pad_collate
from lmforge.errors import DataError
from lmforge.fileio import read_jsonl
from lmforge.interop.chat_template import render_chat
from lmforge.tasks import hh, synthetic
from lmforge.tasks.gsm8k import gsm8k_answer

PROMPT_KEYS = ("prompt", "question", "instruction", "input")
RESPONSE_KEYS = ("response", "completion", "answer", "output")


@dataclass
class SFTExample:
    """One tokenised training sequence; labels are IGNORE on prompt positions."""

    input_ids: list[int]
    labels: list[int]

    @property
    def prompt_len(self) -> int:
        """Tokens before the first trained position."""
        return next((i for i, x in enumerate(self.labels) if x != IGNORE), len(self.labels))


@dataclass
class PreferenceExample:
    """A prompt with two completions, each a full SFTExample (shared prompt, own labels)."""

    chosen: SFTExample
    rejected: SFTExample


@dataclass
class Dataset:
    """Encoded examples plus how many records were skipped as invalid (skip_invalid=True)."""

    examples: list[Any]
    skipped: int = 0
    reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DataError("'messages' must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"messages[{i}] needs 'role' and 'content'")
        if not isinstance(m["content"], str):
            raise DataError(f"messages[{i}].content must be a string")
    return messages


def message_segments(messages: list[dict], tokenizer) -> list[tuple[str, bool]]:
    """(text, trainable) pieces of a rendered conversation; assistant replies are trainable.

    Each assistant reply is the text between the render with a generation prompt and the render
    including the reply, so any prefix-consistent chat template works.
    """
    messages = _check_messages(messages)
    segments: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if not m["content"].strip():
            raise DataError(f"messages[{i}]: empty assistant response")
        prefix = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        full = render_chat(tokenizer, messages[: i + 1])
        if not prefix.startswith(done) or not full.startswith(prefix):
            raise DataError("chat template is not prefix-consistent; cannot mask prompts")
        segments += [(prefix[len(done) :], False), (full[len(prefix) :], True)]
        done = full
    if not segments:
        raise DataError("conversation has no assistant message to train on")
    return segments


def _first(record: dict, keys: Sequence[str], what: str) -> Any:
    for key in keys:
        if key in record:
            return record[key]
    raise DataError(f"missing field '{keys[0]}' ({what}; also accepted: {', '.join(keys[1:])})")


def sft_segments(record: dict, tokenizer) -> list[tuple[str, bool]]:
    """The (text, trainable) pieces of one SFT record, in any accepted form."""
    if "messages" in record:
        return message_segments(record["messages"], tokenizer)
    prompt = _first(record, PROMPT_KEYS, "the prompt")
    response = _first(record, RESPONSE_KEYS, "the response")
    if isinstance(prompt, list):  # conversational prompt + completion
        if not isinstance(response, list):
            response = [{"role": "assistant", "content": response}]
        return message_segments(prompt + response, tokenizer)
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise DataError("prompt and response must be strings (or message lists)")
    if not response.strip():
        raise DataError("empty response")
    return [(prompt, False), (response, True)]


def encode_segments(
    segments: Iterable[tuple[str, bool]], tokenizer, max_len: int, add_bos: bool = False
) -> SFTExample:
    """Token ids + labels (IGNORE on non-trainable text), ending in one trained EOS: appended,
    unless the trained text already holds it (a chat template that ends replies with EOS).

    A prompt that leaves no room for a response token is an error; a too-long response is cut.
    """
    ids: list[int] = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    labels = [IGNORE] * len(ids)
    in_prompt = True  # still before the first trained token
    for text, trainable in segments:
        piece = tokenizer.encode(text) if text else []
        in_prompt = in_prompt and not trainable
        if in_prompt and len(ids) + len(piece) >= max_len:
            raise DataError(
                f"prompt of {len(ids) + len(piece)} tokens does not fit the context "
                f"(max_len={max_len}); shorten it or raise max_len"
            )
        ids += piece
        labels += piece if trainable else [IGNORE] * len(piece)
    eos = tokenizer.eos_id
    if eos is not None:
        trained_eos = [i for i, label in enumerate(labels) if label == eos]
        if not trained_eos:
            ids, labels = ids + [eos], labels + [eos]
        elif not tokenizer.decode(ids[trained_eos[-1] + 1 :]).strip():
            # the template ended the reply itself (ChatML's <|im_end|>\n): the model stops at that
            # token, so the whitespace after it is never generated and is not trained on
            ids, labels = ids[: trained_eos[-1] + 1], labels[: trained_eos[-1] + 1]
    return SFTExample(ids[:max_len], labels[:max_len])


def encode_sft(record: dict, tokenizer, max_len: int, add_bos: bool = False) -> SFTExample:
    """One SFT record -> SFTExample (raises DataError on a bad record)."""
    return encode_segments(sft_segments(record, tokenizer), tokenizer, max_len, add_bos)


def preference_parts(record: dict) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a preference record, the HH form included."""
    for key in ("chosen", "rejected"):
        if key not in record:
            raise DataError(f"missing field '{key}'")
    if "prompt" not in record:
        if isinstance(record["chosen"], str) and hh.ASSISTANT in record["chosen"]:
            pair = hh.parse_hh(record["chosen"], record["rejected"])
            return pair["prompt"], pair["chosen"], pair["rejected"]
        raise DataError("missing field 'prompt' (and not an HH '\\n\\nAssistant:' dialogue)")
    return record["prompt"], record["chosen"], record["rejected"]


def encode_preference(
    record: dict, tokenizer, max_len: int, add_bos: bool = False
) -> PreferenceExample:
    """One preference record -> chosen and rejected SFTExamples sharing the prompt tokens."""
    prompt, chosen, rejected = preference_parts(record)
    pair = []
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(reply, str) and not reply.strip():
            raise DataError(f"empty '{name}' response")
        pair.append(encode_sft({"prompt": prompt, "response": reply}, tokenizer, max_len, add_bos))
    return PreferenceExample(*pair)


# ---------------------------------------------------------------------------- batches


def collate_sft(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, labels (IGNORE on padding), attention_mask [B, T]."""
    ids, mask = pad_collate([e.input_ids for e in examples], pad_id)
    labels, _ = pad_collate([e.labels for e in examples], IGNORE)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def collate_preferences(examples: Sequence[PreferenceExample], pad_id: int) -> dict:
    """Chosen rows then rejected rows in ONE right-padded batch [2B, T] (one forward pass)."""
    rows = [e.chosen for e in examples] + [e.rejected for e in examples]
    return collate_sft(rows, pad_id)


def pack_sft(examples: Sequence[SFTExample], max_len: int) -> list[SFTExample]:
    """Concatenate whole examples into rows of at most max_len tokens (no example is split).

    Packed examples attend to earlier ones in the row, as in TRL's default packing; the labels
    still cover responses only, so the loss is unchanged in what it trains.
    """
    rows: list[SFTExample] = []
    ids, labels = [], []  # the row being filled
    for e in examples:
        if ids and len(ids) + len(e.input_ids) > max_len:
            rows.append(SFTExample(ids, labels))
            ids, labels = [], []
        ids, labels = ids + e.input_ids[:max_len], labels + e.labels[:max_len]
    if ids:
        rows.append(SFTExample(ids, labels))
    return rows


# ---------------------------------------------------------------------------- files and sources


def records_from(source: str | Path | list, kind: str, n: int = 1000, seed: int = 0,
                 split: str = "train") -> list[tuple[str, dict]]:  # fmt: skip
    """(location, record) pairs from a JSONL file, a list of dicts, `task:NAME[:LEVEL][:SPLIT]
    [:chat]` or `file:PATH[:SPLIT][:chat]` (see the module docstring); a source naming its SPLIT
    reads that one, else `split`.

    kind: "sft" | "preference" | "prompts" picks what a built-in task generates. A `:chat` task
    wraps each prompt as one user message, so it is rendered with the chat template (what
    `lmforge chat` sends the model) everywhere: SFT, preferences and RL prompts alike.
    """
    if isinstance(source, list):
        return [(f"records[{i}]", r) for i, r in enumerate(source)]
    source = str(source)
    if spec := re.fullmatch(r"file:(.+?)(?::(train|validation|test))?(:chat)?", source):
        path, part, chat = spec.groups()
        rows = [(f"{path}:{line}", as_chat(r) if chat else r) for line, r in read_jsonl(Path(path))
                if part is None or file_split(r) == part]  # fmt: skip
        if not rows:
            raise DataError(f"{source}: no records in this split")
        return rows[:n]
    if source.startswith("task:"):
        if not (spec := re.fullmatch(r"task:(\w+)(?::(\d+))?(?::(train|validation|test))?"
                                     r"(:chat)?", source)):  # fmt: skip
            raise DataError(f"{source}: expected task:NAME[:LEVEL][:SPLIT][:chat], LEVEL an "
                            "integer")  # fmt: skip
        name, level, part, chat = spec.groups()
        kw = {"digits": int(level), "length": int(level)} if level else {}
        make = {"sft": synthetic.sft_records, "preference": synthetic.preference_pairs,
                "prompts": synthetic.problems}[kind]  # fmt: skip
        records = make(name, n, seed, part or split, **kw)
        return [(f"{source}[{i}]", as_chat(r) if chat else r) for i, r in enumerate(records)]
    return [(f"{source}:{line}", r) for line, r in read_jsonl(Path(source))]


def as_chat(record: Any) -> Any:
    """The record with its string prompt (first of PROMPT_KEYS) as one user message."""
    keys = [k for k in PROMPT_KEYS if isinstance(record, dict) and isinstance(record.get(k), str)]
    return {**record, keys[0]: [{"role": "user", "content": record[keys[0]]}]} if keys else record


def file_split(record: Any) -> str:
    """The split of a `file:` source's record (train / validation / test) by a hash of its
    prompt: a preference pair's (HH: the shared dialogue), a conversation's turns before the
    last, else the first of PROMPT_KEYS; a record without one is hashed whole."""
    try:
        key = (preference_parts(record)[0] if "chosen" in record else record["messages"][:-1]
               if "messages" in record else _first(record, PROMPT_KEYS, ""))  # fmt: skip
    except (DataError, TypeError):
        key = record
    bucket = zlib.crc32(json.dumps(key, sort_keys=True).encode("utf-8")) % 1000
    return "test" if bucket < 100 else "validation" if bucket < 200 else "train"


def _load_records(source, kind: str, encode, skip_invalid: bool, **task_kw) -> Dataset:
    """Every record of `source` (see `records_from`) through `encode(record) -> [examples]`; a
    bad record raises DataError naming file:line, or is counted when `skip_invalid`."""
    out = Dataset([])
    for where, record in records_from(source, kind, **task_kw):
        try:
            if not isinstance(record, dict):  # files are checked by read_jsonl, lists here
                raise DataError(f"expected a JSON object, got {type(record).__name__}")
            out.examples += encode(record)
        except DataError as err:
            if not skip_invalid:
                raise DataError(f"{where}: {err}") from err
            out.skipped += 1
            out.reasons.append(f"{where}: {err}")
    if not out.examples:
        what = source if isinstance(source, str | Path) else "records"
        raise DataError(f"{what}: no valid examples ({out.skipped} skipped: {out.reasons[:1]})")
    return out


def load_sft(source, tokenizer, max_len: int, skip_invalid: bool = False, add_bos: bool = False,
             **task_kw) -> Dataset:  # fmt: skip
    """SFT examples from a JSONL file, list or `task:NAME`; bad records raise or are counted."""
    encode = lambda r: [encode_sft(r, tokenizer, max_len, add_bos)]  # noqa: E731
    return _load_records(source, "sft", encode, skip_invalid, **task_kw)


def load_preferences(source, tokenizer, max_len: int, skip_invalid: bool = False,
                     add_bos: bool = False, **task_kw) -> Dataset:  # fmt: skip
    """Preference examples from a JSONL file (HH form included), list or `task:NAME`."""
    encode = lambda r: [encode_preference(r, tokenizer, max_len, add_bos)]  # noqa: E731
    return _load_records(source, "preference", encode, skip_invalid, **task_kw)


@dataclass
class UnpairedExample:
    """One completion with its label (KTO): an SFTExample (prompt masked in labels) + desirable."""

    example: SFTExample
    desirable: bool


def unpaired_records(record: Any) -> list[tuple[dict, bool]]:
    """The (SFT record, desirable) pairs of one KTO line: {"prompt", "completion", "label"} or
    {"messages", "label"} (the assistant turns are the completion), or a preference pair split in
    two (chosen desirable). A line with none of these, or a label that is not a boolean, raises
    DataError saying what is missing."""
    if "label" not in record:
        if "chosen" in record or "rejected" in record:
            prompt, chosen, rejected = preference_parts(record)
            return [({"prompt": prompt, "response": chosen}, True),
                    ({"prompt": prompt, "response": rejected}, False)]  # fmt: skip
        raise DataError(
            "missing field 'label' (true = desirable, false = undesirable; or give a "
            "preference pair with 'chosen' and 'rejected')"
        )
    label = record["label"]
    if not isinstance(label, bool):
        raise DataError(f"'label' must be true or false, got {label!r}")
    return [(record, label)]  # an SFT record with a label: encode_sft reads it as it is


def load_unpaired(source, tokenizer, max_len: int, skip_invalid: bool = False,
                  add_bos: bool = False, **task_kw) -> Dataset:  # fmt: skip
    """Unpaired examples from a JSONL file, a list of dicts, or `task:NAME` (pairs split)."""
    kind = "preference" if isinstance(source, str) and source.startswith("task:") else "sft"
    encode = lambda record: [  # noqa: E731
        UnpairedExample(encode_sft(r, tokenizer, max_len, add_bos), label)
        for r, label in unpaired_records(record)
    ]
    return _load_records(source, kind, encode, skip_invalid, **task_kw)


def load_prompts(source, n: int = 1000, seed: int = 0, split: str = "train") -> list[dict]:
    """RL prompt records {"prompt", "answer", ...} from a JSONL file, list or `task:NAME`.

    GSM8K files ({"question", "answer": "... #### N"}) are recognised and mapped.
    """
    out = []
    for where, r in records_from(source, "prompts", n=n, seed=seed, split=split):
        if "question" in r and "prompt" not in r:
            try:
                r = {"prompt": r["question"], "answer": gsm8k_answer(str(r.get("answer")))}
            except DataError as err:
                raise DataError(f"{where}: {err}") from err
        if not isinstance(r.get("prompt"), str | list) or not r["prompt"]:
            raise DataError(f"{where}: missing field 'prompt'")
        out.append(r)
    return out


def prompt_ids(record: dict, tokenizer, add_bos: bool = False) -> list[int]:
    """The token ids a model is given for a record's prompt at generation time: the same
    rendering as in training (chat template with a generation prompt for message lists)."""
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if isinstance(prompt, list):
        prompt = render_chat(tokenizer, _check_messages(prompt), add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise DataError("record has no 'prompt' string or message list")
    ids = tokenizer.encode(prompt)
    return [tokenizer.bos_id, *ids] if add_bos and tokenizer.bos_id is not None else ids
