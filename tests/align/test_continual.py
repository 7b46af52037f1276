"""Continual learning: trainable splits, regularisers, forgetting report."""

import json

import pytest
import torch

from lmforge.align import data as D
from lmforge.align.continual import ContinualConfig, ContinualTrainer
from lmforge.align.logprobs import sft_loss
from lmforge.errors import ConfigError

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}


@pytest.fixture
def cfg(tiny_run):
    return lambda out, **kw: tiny_run(ContinualConfig, out, **kw)


def test_bias_only_trains_biases(tmp_path, cfg):
    t = ContinualTrainer(cfg(tmp_path, trainable="bias"), log=lambda *a: None)
    names = list(t.trainable_params())
    assert names and all(n.endswith("bias") for n in names)


def test_penalties_start_at_zero_and_grow(tmp_path, cfg):
    for reg in ("l2", "ewc", "replay"):
        t = ContinualTrainer(cfg(tmp_path / reg, regularizer=reg), log=lambda *a: None)
        assert t.regularizer.penalty().item() == pytest.approx(0.0, abs=1e-6)
        with torch.no_grad():
            for p in t.trainable_params().values():
                p.add_(0.05 * torch.randn_like(p))
        assert t.regularizer.penalty().item() > 0


def sft_eval_loss(model, examples, pad_id):
    """Response-token mean loss of `model` over all examples in one batch: an independent
    measurement of what the forgetting report should hold."""
    b = D.collate_sft(examples, pad_id)
    with torch.no_grad():
        return sft_loss(model(b["input_ids"]), b["labels"]).item()


@pytest.mark.parametrize("trainable", ["full", "lora", "mlp"])
def test_forgetting_report(tmp_path, trainable, cfg):
    """forgetting.json holds the old/new-task held-out losses of the model before and after
    training (measured here independently), forgetting = old loss after - old loss before; the
    frozen part of the split stays bit-identical and the trainable part moves."""
    t = ContinualTrainer(cfg(tmp_path, trainable=trainable, regularizer="replay"),
                         log=lambda *a: None)  # fmt: skip
    model = t.lm.model
    losses = lambda: {"old_loss": sft_eval_loss(model, t.old_eval, t.pad_id),  # noqa: E731
                      "new_loss": sft_eval_loss(model, t.eval_examples, t.pad_id)}  # fmt: skip
    before = losses()
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert trained and (trainable == "full") == (not frozen)
    r = t.run()
    after = losses()
    report = json.loads((tmp_path / "forgetting.json").read_text())
    for when, want in (("before", before), ("after", after)):
        for key, value in want.items():
            assert report[when][key] == pytest.approx(value, rel=1e-5), (when, key)
    assert after["old_loss"] != pytest.approx(before["old_loss"], rel=1e-6)  # training moved it
    # the report's own difference (each side matches the independent measurement above to 1e-5;
    # their difference is ~100x smaller than either, so it is compared to the report's figures)
    old_after, old_before = report["after"]["old_loss"], report["before"]["old_loss"]
    assert report["forgetting"] == pytest.approx(old_after - old_before, rel=1e-6)
    assert r["forgetting"] == pytest.approx(report["forgetting"])
    assert report["steps"] == 3 and report["trainable"] == trainable
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in frozen.items())
    assert any(not torch.equal(params[n], p) for n, p in trained.items())
    assert (tmp_path / "continual.png").is_file()


def test_stop_at_new_loss(tmp_path, cfg):
    r = ContinualTrainer(cfg(tmp_path, max_iters=50, eval_interval=1, stop_at_new_loss=100.0),
                         log=lambda *a: None).run()  # fmt: skip
    assert r["step"] == 1


def test_bad_choice():
    with pytest.raises(ConfigError, match="regularizer"):
        ContinualConfig(regularizer="magic")
