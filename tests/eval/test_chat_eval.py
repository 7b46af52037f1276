"""`lmforge eval chat`: ARC by letter logits, GSM8K through the Engine, centered ChatCORE."""

import json

import pytest
import torch

from lmforge.cli.main import main
from lmforge.data.corpus import builtin_corpus
from lmforge.errors import ConfigError
from lmforge.eval import chat_eval
from lmforge.interop.chat_template import render_chat
from lmforge.lm import LM


@pytest.fixture(scope="module")
def chat_lm(make_tiny_lm) -> LM:
    return make_tiny_lm(256, builtin_corpus("pydoc")[:200], 400)


def test_question_layout():
    text = chat_eval.multiple_choice_message("Which is red?", ["sky", "blood"])
    assert text == (
        "Multiple Choice question: Which is red?\n- sky=A\n- blood=B\n\n"
        "Respond only with the letter of the correct answer."
    )


def test_arc_rows_drop_the_question_prefix(shared_data):
    rows = chat_eval.load_arc(shared_data / "core", "ARC-Challenge", 3)
    assert len(rows) == 3
    first = json.loads((shared_data / "core" / "arc_challenge.jsonl").open().readline())
    assert first["query"].startswith("Question: ")
    assert rows[0]["question"] == first["query"].removeprefix("Question: ").strip()
    assert rows[0]["choices"] == first["choices"] and rows[0]["gold"] == first["gold"]


def reference_arc(lm, rows) -> float:
    """One unpadded forward per question; the argmax over the item's letter logits."""
    tok, model = lm.tokenizer, lm.model.eval()
    correct = 0
    for row in rows:
        msg = chat_eval.multiple_choice_message(row["question"], row["choices"])
        text = render_chat(tok, [{"role": "user", "content": msg}], add_generation_prompt=True)
        ids = tok.encode(text)[-lm.config.max_seq_len :]
        with torch.no_grad():
            last = model(torch.tensor([ids]))[0, -1]
        letters = [tok.encode(c)[0] for c in "ABCDEFGHIJ"[: len(row["choices"])]]
        correct += int(last[letters].argmax()) == row["gold"]
    return correct / len(rows)


def test_arc_batched_agrees_with_reference(chat_lm, shared_data):
    for name in ("ARC-Easy", "ARC-Challenge"):
        rows = chat_eval.load_arc(shared_data / "core", name, 24)
        # the batch of 5 pads prompts of different lengths; the answers must not change
        assert chat_eval.evaluate_arc(chat_lm, rows, batch_size=5) == reference_arc(chat_lm, rows)


def test_gsm8k_replies_are_the_greedy_continuations(chat_lm, shared_data):
    """The Engine's batched replies equal LM.generate's plain greedy decoding, one by one."""
    from lmforge.tasks.gsm8k import load_gsm8k

    # seed 3: this random model's replies are not all special tokens (empty text)
    chat_lm = LM.from_config(chat_lm.config, chat_lm.tokenizer, seed=3)
    rows = load_gsm8k(shared_data / "gsm8k_test.jsonl", 3)
    got = chat_eval.gsm8k_replies(chat_lm, rows, max_new_tokens=12, batch_size=2)
    tok = chat_lm.tokenizer
    end = tok.token_to_id("<|end|>")
    for row, text in zip(rows, got):
        msg = [{"role": "user", "content": row["question"]}]
        ids = tok.encode(render_chat(tok, msg, add_generation_prompt=True))
        new = chat_lm.generate([ids], 12, temperature=0.0, eos_ids=[tok.eos_id, end])[0]
        new = [t for t in new if t not in (tok.eos_id, end)]
        assert text == tok.decode(new, skip_special_tokens=True)
    assert sum(bool(t) for t in got) >= 2


def test_gsm8k_scoring_takes_the_final_number():
    rows = [{"reference": "18"}, {"reference": "3"}, {"reference": "1000"}, {"reference": "5"}]
    replies = ["9 * 2 = 18\n#### 18", "so the answer is 4.", "It costs $1,000.", ""]
    assert chat_eval.score_gsm8k(replies, rows) == 0.5


def test_unknown_task_lists_the_available_ones():
    with pytest.raises(ConfigError, match="unknown task 'MMLU'; available: ARC-Easy, ARC-Chall"):
        chat_eval.select_chat_tasks("arc-easy,MMLU")
    assert chat_eval.select_chat_tasks("gsm8k,arc-easy") == ["GSM8K", "ARC-Easy"]


def test_cli_chat_json_and_bad_input(chat_lm, shared_data, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    chat_lm.save(ckpt)
    out = tmp_path / "chat.json"
    base = ["eval", "chat", "--checkpoint", str(ckpt), "--data", str(shared_data / "core"),
            "--gsm8k", str(shared_data / "gsm8k_test.jsonl")]  # fmt: skip
    assert main([*base, "--max-per-task", "0", "--json", str(out)]) == 2
    assert "--max-per-task must be a positive integer" in capsys.readouterr().err
    assert main([*base, "--tasks", "ARC-Easy,HumanEval", "--json", str(out)]) == 2
    assert "unknown task 'HumanEval'; available:" in capsys.readouterr().err
    assert not out.exists()
    args = ["--max-per-task", "4", "--max-new-tokens", "6", "--json", str(out)]
    assert main([*base, *args]) == 0
    got = json.loads(out.read_text())
    assert set(got) == {"results", "centered", "chatcore"}
    assert list(got["results"]) == ["ARC-Easy", "ARC-Challenge", "GSM8K"]
    acc = got["results"]["ARC-Easy"]
    assert got["centered"]["ARC-Easy"] == pytest.approx((acc - 0.25) / 0.75)
    assert got["centered"]["GSM8K"] == got["results"]["GSM8K"]
    assert got["chatcore"] == pytest.approx(sum(got["centered"].values()) / 3)


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_instruct_arc_agrees_with_reference(shared_data, smollm2_gguf):
    lm = LM.load(smollm2_gguf, dtype="float32")
    rows = chat_eval.load_arc(shared_data / "core", "ARC-Easy", 20)
    acc = chat_eval.evaluate_arc(lm, rows, batch_size=8)
    # (135M at Q4_1 is near chance here: it answers with a letter, mostly "A")
    assert acc == reference_arc(lm, rows)
