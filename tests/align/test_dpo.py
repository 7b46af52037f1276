"""DPO trainer: ln 2 at init for any β, completion-only log-probs, precomputed reference."""

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from lmforge.align import data as D
from lmforge.align.dpo import DPOConfig, DPOTrainer, completion_logprob_sums
from lmforge.align.trainer import load_lm
from lmforge.errors import ConfigError

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}


@pytest.fixture
def cfg(tiny_run):
    fields = dict(max_iters=4, eval_interval=4, lr=1e-3)
    return lambda out, **kw: tiny_run(DPOConfig, out, **{**fields, **kw})


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0])
def test_loss_is_ln2_at_init(tmp_path, beta, cfg):
    t = DPOTrainer(cfg(tmp_path, beta=beta), log=lambda *a: None)
    loss, stats = t.loss(t.batch([0, 1, 2, 3]))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5)
    assert stats["margin"] == pytest.approx(0.0, abs=1e-5)


def test_logprobs_count_completion_tokens_only():
    lm = load_lm("scratch", TINY, 24, 0, "cpu")
    tok = lm.tokenizer
    a = D.encode_preference({"prompt": "1+1=", "chosen": "2", "rejected": "3"}, tok, 24)
    b = D.encode_preference({"prompt": "9*9=", "chosen": "2", "rejected": "3"}, tok, 24)
    logits_fn = lm.model
    for ex in (a, b):
        batch = D.collate_preferences([ex], tok.pad_id)
        lp = completion_logprob_sums(logits_fn, batch)
        full = torch.log_softmax(lm.model(batch["input_ids"]), -1)[0]
        ids = batch["input_ids"][0]
        expect = sum(full[t - 1, ids[t]] for t in range(4, 6))  # answer digit + EOS
        assert lp[0].item() == pytest.approx(expect.item(), abs=1e-5)


def test_lora_reference_is_the_policy_with_adapters_off(tmp_path, cfg):
    """No second copy of the weights: π_ref is the LoRA policy with its adapters switched off,
    and stays the starting model while the adapters train."""
    pre = DPOTrainer(cfg(tmp_path / "a", peft="lora"), log=lambda *a: None)
    live = DPOTrainer(cfg(tmp_path / "b", peft="lora", precompute_ref=False),
                      log=lambda *a: None)  # fmt: skip
    assert pre.ref is None and live.ref is None
    for _ in range(3):
        live.train_step()
    b = live.batch([3, 1])
    assert torch.allclose(pre.batch([3, 1])["ref"], b["ref"], atol=1e-5)
    with torch.no_grad():
        policy = completion_logprob_sums(live.lm.model, b).view(2, -1).T
    assert (policy - b["ref"]).abs().max() > 1e-3  # the adapters did move the policy


def test_precomputed_reference_equals_per_step(tmp_path, cfg):
    pre = DPOTrainer(cfg(tmp_path / "a"), log=lambda *a: None)
    live = DPOTrainer(cfg(tmp_path / "b", precompute_ref=False), log=lambda *a: None)
    assert torch.allclose(pre.batch([3, 1])["ref"], live.batch([3, 1])["ref"], atol=1e-5)


def test_bad_beta():
    with pytest.raises(ConfigError):
        DPOConfig(beta=0)


def test_dpo_end_to_end(tmp_path, cfg):
    r = DPOTrainer(cfg(tmp_path, max_iters=6, eval_interval=3, label_smoothing=0.1),
                   log=lambda *a: None).run()  # fmt: skip
    assert math.isfinite(r["loss"]) and r["initial_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "dpo.png").is_file()


def test_dpo_with_lora(tmp_path, cfg):
    t = DPOTrainer(cfg(tmp_path, peft="lora"), log=lambda *a: None)
    t.train_step()
    t.export(tmp_path)
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_rpo_adds_the_chosen_per_token_nll(tmp_path, cfg):
    t = DPOTrainer(cfg(tmp_path, rpo_alpha=0.5), log=lambda *a: None)
    b = t.batch([0, 1, 2, 3])
    loss, _ = t.loss(b)
    logits = t.lm.model(b["input_ids"][:4])
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), b["labels"][:4, 1:].flatten(), ignore_index=-100
    )
    assert loss.item() == pytest.approx(math.log(2) + 0.5 * nll.item(), abs=1e-4)
    with pytest.raises(ConfigError, match="rpo_alpha"):
        DPOConfig(rpo_alpha=-1)


def test_dpo_on_policy_pairs(tmp_path, cfg, monkeypatch):
    """pairs_from policy: the pairs are the starting model's own samples, the chosen one right
    and the rejected one wrong by the verifier; they are written as text for a baseline to
    train on; eval_generate adds greedy exact match to the evaluation."""
    import json

    import lmforge.align.reward as reward_module

    def odd_first(record, completion):  # a stand-in verifier: right when it starts odd
        return float(completion[:1] != "" and completion[:1] in "13579")

    monkeypatch.setattr(reward_module, "verify", odd_first)
    t = DPOTrainer(cfg(tmp_path, data="task:add:1", pairs_from="policy", pair_samples=8,
                       pair_max_new_tokens=3, eval_generate=4, max_new_tokens=3),
                   log=lambda *a: None)  # fmt: skip
    tok = t.tokenizer
    assert t.train_examples and t.eval_examples
    for e in t.train_examples + t.eval_examples:
        n = e.chosen.prompt_len
        right, wrong = (tok.decode(x.input_ids[n:], skip_special_tokens=True)
                        for x in (e.chosen, e.rejected))  # fmt: skip
        assert odd_first({}, right) == 1.0 and odd_first({}, wrong) == 0.0
    written = [json.loads(line) for line in (tmp_path / "policy_pairs_train.jsonl").open()]
    assert len(written) == len(t.train_examples)
    for row, e in zip(written, t.train_examples):
        n = e.chosen.prompt_len
        assert row["prompt"] == tok.decode(e.chosen.input_ids[:n])
        assert row["chosen"] == tok.decode(e.chosen.input_ids[n:], skip_special_tokens=True)
    result = t.run()
    assert 0.0 <= result["exact_match"] <= 1.0 and math.isfinite(result["loss"])
    with pytest.raises(ConfigError, match="pairs_from"):
        DPOConfig(pairs_from="labellers")


ROOT = Path(__file__).resolve().parents[2]


def walk_files(number: int) -> tuple[list[str], set[str]]:
    """(numbered step files, leaf files and folders) of walk `number` of docs/ARCHITECTURE.md;
    "as in walk 1" adds walk 1's leaves."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = re.search(rf"### Walk {number}:(.*?)(?=\n### |\n## )", text, re.S).group(1)
    steps_text, _, leaves_text = section.partition("\nLeaves:")
    steps = list(dict.fromkeys(re.findall(r"\d+\. `([\w/]+\.py)`", steps_text)))
    leaves = set(re.findall(r"`([\w/]+(?:\.py|/))`", leaves_text))
    if "as in walk 1" in " ".join(leaves_text.split()) and number != 1:
        leaves |= walk_files(1)[1]
    return steps, leaves


def test_train_step_runs_the_files_walk_3_names(tmp_path, cfg):
    """Walk 3 measured: every lmforge file whose code runs in one train_step (recorded with
    sys.setprofile) is one of the walk's numbered steps or leaves, the steps are at most 7
    files, and each step after the entry point (cli/post_train.py) does run."""
    steps, leaves = walk_files(3)
    assert len(steps) <= 7, steps
    trainer = DPOTrainer(cfg(tmp_path), log=lambda *a: None)
    package = str(ROOT / "lmforge") + "/"
    ran: set[str] = set()

    def record(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(package):
            ran.add(frame.f_code.co_filename[len(package) :])

    sys.setprofile(record)
    try:
        trainer.train_step()
    finally:
        sys.setprofile(None)
    unnamed = {f for f in ran - set(steps) if not any(f.startswith(x) for x in leaves)}
    assert not unnamed, f"the DPO step runs files walk 3 does not name: {sorted(unnamed)}"
    assert set(steps[1:]) <= ran, set(steps[1:]) - ran
