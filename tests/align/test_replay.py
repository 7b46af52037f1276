"""Pretraining-text replay in post-training (align/replay.py): the windows, the loss it adds to
SFT / DPO / GRPO, and bad settings."""

import numpy as np
import pytest
import torch

from lmforge.align.dpo import DPOConfig, DPOTrainer
from lmforge.align.grpo import GRPOConfig, GRPOTrainer
from lmforge.align.logprobs import sft_loss
from lmforge.align.replay import Replay, load_replay_tokens
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.errors import ConfigError, DataError

TINY = {"n_layer": 1, "d_model": 32, "n_head": 2}
TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def quiet(*a):
    pass


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "replay.txt"
    path.write_text(TEXT)
    return path


def sft_cfg(out, **kw):
    base = dict(out_dir=str(out), model=TINY, max_len=24, n_train=64, n_eval=16, batch_size=8,
                max_iters=4, eval_interval=100, eval_generate=0, progress=False, threads=1,
                warmup_iters=1, lr=3e-3)  # fmt: skip
    return SFTConfig(**{**base, **kw})


def test_windows_depend_only_on_seed_rank_step_and_call():
    tokens = np.arange(1000, dtype=np.int64)
    a = Replay(tokens, batch_size=4, block_size=16, seed=3)
    b = Replay(tokens, batch_size=4, block_size=16, seed=3)
    first = a.windows(7)
    assert first.shape == (4, 16)
    # contiguous slices of the stream
    assert torch.equal(first[:, 1:] - first[:, :-1], torch.ones(4, 15, dtype=torch.long))
    assert torch.equal(b.windows(7), first)  # a resumed run at step 7 draws the same windows
    assert not torch.equal(a.windows(7), first)  # a second call in one step draws new ones
    assert not torch.equal(a.windows(8), b.windows(9))
    other_rank = Replay(tokens, batch_size=4, block_size=16, seed=3, rank=1)
    assert not torch.equal(other_rank.windows(7), first)


def test_sft_loss_is_task_loss_plus_coef_times_replay_loss(tmp_path, text_file):
    trainer = SFTTrainer(sft_cfg(tmp_path, replay_data=str(text_file), replay_coef=0.25,
                                 replay_batch_size=3, replay_block_size=12), log=quiet)  # fmt: skip
    batch = trainer.batch(list(range(8)))
    loss, stats = trainer.loss(batch)
    plain = sft_loss(trainer.lm.model(batch["input_ids"]), batch["labels"])
    again = Replay.from_config(trainer.cfg.replay, trainer)
    ids = again.windows(trainer.step)
    assert ids.shape == (3, 12)
    replayed = sft_loss(trainer.lm.model(ids), ids)
    assert stats["replay_loss"] == pytest.approx(replayed.item(), rel=1e-5)
    assert loss.item() == pytest.approx(plain.item() + 0.25 * replayed.item(), rel=1e-5)
    # off: the loss is the task loss alone
    off = SFTTrainer(sft_cfg(tmp_path / "off"), log=quiet)
    loss_off, stats_off = off.loss(off.batch(list(range(8))))
    assert "replay_loss" not in stats_off


def test_replay_keeps_the_replayed_text_learnt(tmp_path, text_file):
    """Fine-tuning on the task alone leaves the replay text's loss high; with replay it falls."""
    losses = {}
    for coef in (0.0, 1.0):
        cfg = sft_cfg(tmp_path / str(coef), replay_data=str(text_file), replay_coef=coef,
                      max_iters=40)  # fmt: skip
        trainer = SFTTrainer(cfg, log=quiet)
        trainer.run()
        probe = Replay(load_replay_tokens(str(text_file), trainer.tokenizer, 10_000), 16,
                       24, seed=99)  # fmt: skip
        with torch.no_grad():
            losses[coef] = probe.loss(trainer.lm.model.eval(), 0).item()
    assert losses[1.0] < 0.8 * losses[0.0], losses  # measured: 3.02 vs 4.55


def test_dpo_and_grpo_add_the_replay_term(tmp_path, text_file):
    common = dict(model=TINY, max_len=24, n_train=32, n_eval=8, batch_size=4, max_iters=1,
                  eval_interval=100, progress=False, threads=1, replay_data=str(text_file),
                  replay_coef=1.0, replay_block_size=16)  # fmt: skip
    dpo = DPOTrainer(DPOConfig(out_dir=str(tmp_path / "dpo"), **common), log=quiet)
    _, stats = dpo.loss(dpo.batch([0, 1, 2, 3]))
    assert stats["replay_loss"] > 0
    grpo = GRPOTrainer(GRPOConfig(out_dir=str(tmp_path / "grpo"), group_size=2, max_new_tokens=4,
                                  **common), log=quiet)  # fmt: skip
    calls = []
    original = Replay.loss

    def spy(self, model, step):
        calls.append(step)
        return original(self, model, step)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Replay, "loss", spy)
        grpo.train_step()
    assert calls == [0]


def test_bad_replay_settings(tmp_path, text_file):
    with pytest.raises(ConfigError, match="replay_coef"):
        sft_cfg(tmp_path, replay_coef=-1.0)
    with pytest.raises(ConfigError, match="replay_block_size"):
        sft_cfg(tmp_path, replay_block_size=0)
    with pytest.raises(ConfigError, match="token shard not found"):
        sft_cfg(tmp_path, replay_data=str(tmp_path / "missing.bin"))
    shard = tmp_path / "data" / "train.bin"
    shard.parent.mkdir()
    np.arange(100, dtype=np.uint16).tofile(shard)
    (shard.parent / "meta.json").write_text('{"dtype": "uint16", "vocab_size": 50000}')
    trainer = SFTTrainer(sft_cfg(tmp_path / "run", replay_data=str(shard)), log=quiet)
    with pytest.raises(DataError, match="vocabulary of 50000"):
        trainer.with_replay(torch.zeros(()), {})
