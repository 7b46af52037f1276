"""Continual learning: trainable splits, regularisers, forgetting report."""

import json
import math

import pytest
import torch

from lmforge.align.continual import ContinualConfig, ContinualTrainer
from lmforge.errors import ConfigError

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}


def cfg(out, **kw):
    base = dict(
        out_dir=str(out),
        model=TINY,
        max_len=24,
        n_train=32,
        n_eval=16,
        batch_size=8,
        max_iters=3,
        eval_interval=3,
        progress=False,
        threads=1,
        warmup_iters=1,
    )
    return ContinualConfig(**{**base, **kw})


def test_bias_only_trains_biases(tmp_path):
    t = ContinualTrainer(cfg(tmp_path, trainable="bias"), log=lambda *a: None)
    names = list(t.trainable_params())
    assert names and all(n.endswith("bias") for n in names)


def test_penalties_start_at_zero_and_grow(tmp_path):
    for reg in ("l2", "ewc", "replay"):
        t = ContinualTrainer(cfg(tmp_path / reg, regularizer=reg), log=lambda *a: None)
        assert t.regularizer.penalty().item() == pytest.approx(0.0, abs=1e-6)
        with torch.no_grad():
            for p in t.trainable_params().values():
                p.add_(0.05 * torch.randn_like(p))
        assert t.regularizer.penalty().item() > 0


@pytest.mark.parametrize("trainable", ["full", "lora", "mlp"])
def test_forgetting_report(tmp_path, trainable):
    r = ContinualTrainer(cfg(tmp_path, trainable=trainable, regularizer="replay"),
                         log=lambda *a: None).run()  # fmt: skip
    report = json.loads((tmp_path / "forgetting.json").read_text())
    assert report["forgetting"] == pytest.approx(r["forgetting"])
    assert math.isfinite(report["after"]["old_loss"])
    assert (tmp_path / "continual.png").is_file()


def test_stop_at_new_loss(tmp_path):
    r = ContinualTrainer(cfg(tmp_path, max_iters=50, eval_interval=1, stop_at_new_loss=100.0),
                         log=lambda *a: None).run()  # fmt: skip
    assert r["step"] == 1


def test_bad_choice():
    with pytest.raises(ConfigError, match="regularizer"):
        ContinualConfig(regularizer="magic")
