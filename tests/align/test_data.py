"""SFT / preference encoding: response-only labels, chat rendering, packing, validation."""

import json

import pytest
import torch

from lmforge.align import data as D
from lmforge.align.logprobs import sft_loss
from lmforge.errors import DataError
from lmforge.interop.chat_template import render_chat
from lmforge.tasks import synthetic
from lmforge.tasks.gsm8k import load_gsm8k
from lmforge.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_char([synthetic.ALPHABET])


def test_prompt_masked_eos_trained(tok):
    e = D.encode_sft({"prompt": "12+3=", "response": "15"}, tok, 32)
    assert e.input_ids == tok.encode("12+3=") + tok.encode("15") + [tok.eos_id]
    assert e.labels == [D.IGNORE] * 5 + tok.encode("15") + [tok.eos_id]
    assert e.prompt_len == 5


def test_prompt_masking_invariance(tok):
    """Completion-only loss: changing logits at prompt positions leaves the SFT loss unchanged."""
    b = D.collate_sft([D.encode_sft({"prompt": "12+3=", "response": "15"}, tok, 32)], tok.pad_id)
    logits = torch.randn(1, b["input_ids"].shape[1], tok.vocab_size)
    base = sft_loss(logits, b["labels"])
    changed = logits.clone()
    changed[:, :4] = torch.randn_like(changed[:, :4]) * 10  # positions predicting prompt tokens
    assert torch.allclose(sft_loss(changed, b["labels"]), base)
    changed[0, 5, 3] += 5  # a position predicting a response token does matter
    assert not torch.allclose(sft_loss(changed, b["labels"]), base)


def test_builtin_chat_template(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert render_chat(tok, msgs) == "<|user|>hi<|end|><|assistant|>yo<|end|>"
    e = D.encode_sft({"messages": msgs}, tok, 64)
    trained = [x for x in e.labels if x != D.IGNORE]
    assert trained == tok.encode("yo<|end|>") + [tok.eos_id]


CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>'"
    " + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chatml_reply_ends_in_exactly_one_end_token():
    """A template that ends each reply with EOS (ChatML, EOS = <|im_end|>) gets no second EOS
    appended, and the newline after the final one is not trained (issue 20 item 5)."""
    specials = {"bos": "<|im_start|>", "eos": "<|im_end|>", "pad": "<|pad|>", "unk": "<|unk|>"}
    base = Tokenizer.train_char([synthetic.ALPHABET], special_tokens=specials)
    tok = Tokenizer(base.backend, base.kind, base.special_tokens, chat_template=CHATML)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Done."}]
    e = D.encode_sft({"messages": msgs}, tok, 128)
    trained = [x for x in e.labels if x != D.IGNORE]
    assert tok.decode(trained) == "Done.<|im_end|>"
    assert e.input_ids[-1] == e.labels[-1] == tok.eos_id and e.input_ids[-2] != tok.eos_id
    assert (
        tok.decode(e.input_ids)
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nDone.<|im_end|>"
    )
    # the built-in template's <|end|> is not EOS: EOS is appended, once
    plain = D.encode_sft({"messages": msgs}, base, 128)
    assert base.decode([x for x in plain.labels if x != D.IGNORE]) == "Done.<|end|><|im_end|>"


def test_multi_turn_trains_every_assistant_reply(tok):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]  # fmt: skip
    e = D.encode_sft({"messages": msgs}, tok, 64)
    text = tok.decode([i for i, x in zip(e.input_ids, e.labels) if x != D.IGNORE])
    assert text == "b<|end|>d<|end|><|eos|>"


def test_tokenizer_chat_template_is_used(tok):
    t = Tokenizer(tok.backend, tok.kind, tok.special_tokens,
                  chat_template="{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};"
                  "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")  # fmt: skip
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    e = D.encode_sft({"messages": msgs}, t, 64)
    assert t.decode(e.input_ids) == "u:hi;a:yo;<|eos|>"
    assert t.decode([x for x in e.labels if x != D.IGNORE]) == "yo;<|eos|>"


def test_preference_batch_is_chosen_then_rejected(tok):
    ex = D.encode_preference({"prompt": "1+1=", "chosen": "2", "rejected": "33"}, tok, 32)
    b = D.collate_preferences([ex], tok.pad_id)
    assert b["input_ids"].shape == (2, 7)
    assert b["attention_mask"].tolist() == [[1] * 6 + [0], [1] * 7]
    assert (b["labels"][:, :4] == D.IGNORE).all()


def test_hh_form_preferences(tok):
    rec = {"chosen": "\n\nHuman: hi\n\nAssistant: yo", "rejected": "\n\nHuman: hi\n\nAssistant: no"}
    ex = D.encode_preference(rec, tok, 64)
    assert (
        ex.chosen.prompt_len
        == ex.rejected.prompt_len
        == len(tok.encode("\n\nHuman: hi\n\nAssistant:"))
    )


def test_packing_keeps_labels_and_never_splits(tok):
    exs = D.load_sft("task:add", tok, 32, n=50).examples
    rows = D.pack_sft(exs, 40)
    assert all(len(r.input_ids) <= 40 for r in rows)
    assert sum(len(r.input_ids) for r in rows) == sum(len(e.input_ids) for e in exs)
    assert sum(x != D.IGNORE for r in rows for x in r.labels) == sum(
        x != D.IGNORE for e in exs for x in e.labels
    )


def test_validation_errors_name_file_and_line(tmp_path, tok):
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": "a", "response": "b"}, {"prompt": "a"}, {"prompt": "a", "response": " "},
            {"prompt": "x" * 100, "response": "b"}]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError, match=r"sft.jsonl:2: missing field 'response'"):
        D.load_sft(path, tok, 32)
    ds = D.load_sft(path, tok, 32, skip_invalid=True)
    assert len(ds) == 1 and ds.skipped == 3
    assert "sft.jsonl:3: empty response" in ds.reasons[1]
    assert "sft.jsonl:4: prompt of 100 tokens does not fit" in ds.reasons[2]


def test_preference_validation(tmp_path, tok):
    path = tmp_path / "pref.jsonl"
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "b"},
            {"prompt": "a", "chosen": "", "rejected": "c"}]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(DataError, match=r"pref.jsonl:2: missing field 'rejected'"):
        D.load_preferences(path, tok, 32)
    ds = D.load_preferences(path, tok, 32, skip_invalid=True)
    assert len(ds) == 1 and ds.skipped == 2 and "empty 'chosen'" in ds.reasons[1]


def test_load_prompts_gsm8k(shared_data):
    rows = D.load_prompts(shared_data / "gsm8k_test.jsonl")
    assert rows[0]["answer"] == load_gsm8k(shared_data / "gsm8k_test.jsonl", 1)[0]["reference"]


def test_chat_task_sources_wrap_prompts_as_user_messages(tok):
    plain = D.records_from("task:add:2", "prompts", n=5)
    chat = D.records_from("task:add:2:chat", "prompts", n=5)
    assert [r["prompt"] for _, r in plain] == [r["prompt"][0]["content"] for _, r in chat]
    assert all(r["prompt"][0]["role"] == "user" for _, r in chat)
    pair = D.records_from("task:add:chat", "preference", n=1)[0][1]
    ex = D.encode_preference(pair, tok, 64)
    assert ex.chosen.prompt_len == ex.rejected.prompt_len > len(tok.encode(pair["answer"]))
    with pytest.raises(DataError, match="task:NAME"):
        D.records_from("task:add:two", "sft", n=1)
