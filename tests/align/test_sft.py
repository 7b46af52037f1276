"""SFT trainer: full fine-tuning and PEFT variants, export, exact-match evaluation."""

import math

import pytest
import torch

from lmforge.align.sft import SFTConfig, SFTTrainer, greedy_accuracy
from lmforge.align.trainer import load_lm
from lmforge.lm import LM
from lmforge.peft.export import dense_copy, load_peft
from lmforge.peft.lora import lora_modules
from lmforge.tasks import synthetic

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}


@pytest.fixture
def cfg(tiny_run):
    fields = dict(n_train=64, max_iters=4, eval_interval=4, eval_generate=8)
    return lambda out, **kw: tiny_run(SFTConfig, out, **{**fields, **kw})


def quiet(*a):
    pass


def test_greedy_accuracy_counts_verified_completions():
    """greedy_accuracy = the share of records whose greedy completion `verify` accepts, over every
    chunk of the batch: a stub generate answers 3 of 5 prompts right (one with a trailing line
    and EOS, which the verifier ignores) and the others wrong."""
    lm = load_lm("scratch", TINY, 24, 0, "cpu")
    tok = lm.tokenizer
    records = synthetic.problems("add", 5, seed=0)
    replies = {
        0: f"{records[0]['answer']}\nmore",
        1: str(int(records[1]["answer"]) + 1),
        2: records[2]["answer"],
        3: f" {records[3]['answer']}",
        4: "",
    }
    by_prompt = {tuple(tok.encode(r["prompt"])): i for i, r in enumerate(records)}
    calls = []

    def generate(prompts, max_new_tokens, temperature, **kw):
        calls.append((len(prompts), max_new_tokens, temperature))
        return [tok.encode(replies[by_prompt[tuple(p)]]) + [tok.eos_id] for p in prompts]

    lm.generate = generate
    assert greedy_accuracy(lm, records, max_new_tokens=4, batch=2) == pytest.approx(3 / 5)
    assert calls == [(2, 4, 0.0), (2, 4, 0.0), (1, 4, 0.0)]  # greedy, every record once
    assert greedy_accuracy(lm, [], max_new_tokens=4) == 0.0


@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_lora_export_merged_equals_wrapped(tmp_path, peft, cfg):
    t = SFTTrainer(cfg(tmp_path, peft=peft, lora_targets="qkv_proj,up_proj"), log=quiet)
    assert lora_modules(t.lm.model) and t.peft_names[0].endswith("qkv_proj")
    for _ in range(3):
        t.train_step()
    t.export(tmp_path)
    x = torch.randint(0, t.tokenizer.vocab_size, (2, 10))
    merged = LM.load(tmp_path).model
    t.lm.model.eval()
    assert torch.allclose(merged(x), t.lm.model(x), atol=1e-4 if peft == "lora" else 1e-3)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_adapter_saved_alone_and_reloads(tmp_path, cfg):
    t = SFTTrainer(cfg(tmp_path, peft="adapter", adapter_bottleneck=8), log=quiet)
    for _ in range(3):
        t.train_step()
    t.export(tmp_path)
    base = LM.load(tmp_path)
    load_peft(base.model, tmp_path / "adapter")
    x = torch.randint(0, t.tokenizer.vocab_size, (2, 10))
    t.lm.model.eval()
    assert torch.allclose(base.model(x), t.lm.model(x), atol=1e-5)


def test_dense_copy_has_no_lora(tmp_path, cfg):
    t = SFTTrainer(cfg(tmp_path, peft="lora"), log=quiet)
    assert not lora_modules(dense_copy(t.lm.model))


def test_sft_end_to_end(tmp_path, cfg):
    r = SFTTrainer(cfg(tmp_path, max_iters=40, eval_interval=20, packing=True), log=quiet).run()
    assert math.isfinite(r["loss"]) and r["loss"] < r["initial_loss"]
    assert "exact_match" in r
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "sft.png").is_file()
    assert (tmp_path / "metrics.csv").is_file()
    LM.load(tmp_path)
