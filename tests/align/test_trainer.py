"""The shared post-training loop: config, sampler, checkpoint + exact resume."""

import pytest
import torch

from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.align.trainer import EpochSampler, eval_source, load_lm
from lmforge.errors import CheckpointError, ConfigError
from lmforge.lm import LM
from lmforge.tasks.synthetic import in_split
from lmforge.train.config import build_config

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}


@pytest.fixture
def tiny_cfg(tiny_run):
    fields = dict(n_train=64, max_iters=6, eval_interval=3, eval_generate=0)
    return lambda out, **kw: tiny_run(SFTConfig, out, **{**fields, **kw})


def test_sampler_covers_each_epoch_and_resumes():
    s = EpochSampler(10, 3, seed=0)
    first = [i for _ in range(3) for i in s.next()]
    assert len(set(first)) == 9  # no repeats within an epoch
    state = s.state_dict()
    after = [s.next() for _ in range(4)]
    t = EpochSampler(10, 3, seed=0)
    t.load_state_dict(state)
    assert [t.next() for _ in range(4)] == after


def test_config_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.01\nmodel:\n  n_layer: 3\n")
    cfg = build_config(SFTConfig, path, {"model.d_model": 48, "peft": "lora"})
    assert cfg.optim.lr == 0.01 and cfg.model == {"n_layer": 3, "d_model": 48}
    assert cfg.peft.method == "lora"  # a flat key of the peft section
    with pytest.raises(ConfigError, match="unknown key"):
        build_config(SFTConfig, None, {"nope": 1})
    with pytest.raises(ConfigError, match="batch_size"):
        SFTConfig(batch_size=0)


def test_scratch_model_and_missing_checkpoint(tmp_path):
    lm = load_lm("scratch", TINY, 24, 0, "cpu")
    assert lm.tokenizer is not None and lm.config.max_seq_len == 24
    with pytest.raises(CheckpointError):
        load_lm(str(tmp_path / "none"), {}, 24, 0, "cpu")


def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_cfg):
    straight = SFTTrainer(tiny_cfg(tmp_path / "a"), log=lambda *a: None)
    straight.run()
    half = SFTTrainer(
        tiny_cfg(tmp_path / "b", max_iters=6, checkpoint_interval=3), log=lambda *a: None
    )
    for _ in range(3):
        half.train_step()
    half.save_checkpoint()
    resumed = SFTTrainer(tiny_cfg(tmp_path / "b"), resume=True, log=lambda *a: None)
    assert resumed.step == 3
    resumed.run()
    a, b = LM.load(tmp_path / "a").model, LM.load(tmp_path / "b").model
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-6), n


def test_resume_without_state_fails(tmp_path, tiny_cfg):
    with pytest.raises(CheckpointError, match="--resume"):
        SFTTrainer(tiny_cfg(tmp_path), resume=True)


def test_task_runs_evaluate_on_validation(tmp_path, tiny_cfg):
    """A built-in task's periodic evaluation reads its validation split (where steps are chosen),
    never test; test stays selectable as eval_data `task:NAME:LEVEL:test`."""
    cfg = tiny_cfg(tmp_path, data="task:add:2", eval_generate=8)
    assert eval_source(cfg) == ("task:add:2", "validation")
    trainer = SFTTrainer(cfg, log=lambda *a: None)
    assert len(trainer.eval_records) == 8
    assert all(in_split(r["prompt"], "validation") for r in trainer.eval_records)
    cfg = tiny_cfg(tmp_path, data="task:add:2", eval_data="task:add:2:test", eval_generate=8)
    records = SFTTrainer(cfg, log=lambda *a: None).eval_records
    assert all(in_split(r["prompt"], "test") for r in records)
