"""Every DPO and GRPO loss_type runs through lmforge's own trainers (their formulas are checked
against TRL in trl_oracle/), and an unknown loss_type or a bad setting is one ConfigError."""

import pytest
import torch

from lmforge.align import dpo as lm_dpo
from lmforge.align import grpo as lm_grpo
from lmforge.align.preference_losses import dpo_loss
from lmforge.align.rl_losses import grpo_loss
from lmforge.errors import ConfigError

TINY = {"n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": 32}


@pytest.mark.parametrize("loss_type", ["robust", "hinge", "ipo"])
def test_lmforge_dpo_trainer_steps_with_every_loss_type(tmp_path, loss_type):
    """The new DPO loss_types run through lmforge's own trainer (real batches, lengths, step)."""
    cfg = lm_dpo.DPOConfig(out_dir=str(tmp_path), init="scratch", model=TINY, data="task:add:1",
                           n_train=16, n_eval=4, batch_size=4, max_iters=1, eval_interval=1,
                           progress=False, threads=1, loss_type=loss_type,
                           label_smoothing=0.1 if loss_type == "robust" else 0.0)  # fmt: skip
    t = lm_dpo.DPOTrainer(cfg, log=lambda *a: None)
    before = [p.detach().clone() for p in t.lm.model.parameters()]
    t.train_step()
    assert any(not torch.equal(p, b) for p, b in zip(t.lm.model.parameters(), before))


@pytest.mark.parametrize(
    "kw",
    [
        {"loss_type": "dapo", "clip_eps_high": 0.28, "mask_truncated": True, "minibatch_size": 4},
        {"loss_type": "dr_grpo", "beta": 0.05, "kl_correction": True},
        {"loss_type": "bnpo", "num_iterations": 2},
        {"loss_type": "rloo", "beta": 0.05, "normalize_advantages": True},
    ],
)
def test_lmforge_grpo_trainer_steps_with_every_loss_type(tmp_path, kw):
    """GRPO's loss_types run through lmforge's trainer: rollout, prepare, minibatches, step."""
    cfg = lm_grpo.GRPOConfig(out_dir=str(tmp_path), init="scratch", model=TINY, data="task:add:1",
                             n_train=16, n_eval=4, batch_size=2, group_size=4, max_new_tokens=4,
                             max_iters=1, eval_interval=1, progress=False, threads=1, lr=1e-2,
                             **kw)  # fmt: skip
    rewards = iter([1.0, 0.0, 0.0, 0.5] * 4)
    t = lm_grpo.GRPOTrainer(cfg, log=lambda *a: None, reward=lambda rec, comp: next(rewards))
    rollout = t.rollout([0, 1])
    if kw.get("mask_truncated"):  # even rows: cut at max_new_tokens; odd rows: stop at token 2
        stop, p = t.engine.stop_ids[0], rollout.prompt_width
        rollout.completion_mask[0::2] = 1.0
        rollout.input_ids[0::2, p:] = 5  # not a stop token
        rollout.completion_mask[1::2] = torch.tensor([1.0, 1.0, 0.0, 0.0])
        rollout.input_ids[1::2, p + 1] = stop
    before = [p.detach().clone() for p in t.lm.model.parameters()]
    stats = t.update(rollout)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values())
    assert any(not torch.equal(p, b) for p, b in zip(t.lm.model.parameters(), before))
    if kw.get("mask_truncated"):  # the cut rows no longer count, the finished ones do
        assert rollout.completion_mask.sum(-1).tolist() == [0.0, 2.0] * 4


def test_bad_loss_types_are_config_errors():
    with pytest.raises(ConfigError, match="loss_type"):
        lm_dpo.DPOConfig(loss_type="sppo")
    with pytest.raises(ConfigError, match="label_smoothing"):
        lm_dpo.DPOConfig(loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ConfigError, match="loss_type"):
        lm_grpo.GRPOConfig(group_size=2, loss_type="cispo")
    with pytest.raises(ConfigError, match="max_completion_length"):
        ones = torch.ones(1, 2)
        grpo_loss(ones, None, None, torch.ones(1), ones, loss_type="dr_grpo")
    with pytest.raises(ConfigError, match="lengths"):
        dpo_loss(*torch.zeros(4, 2), loss_type="ipo")
