"""PPO wiring: GAE/targets on hand-computed rollouts (SPEC §10 vector), KL shaping, the PPO-KL
penalty, KL = 0 at the start, and short end-to-end runs with both critics."""

import pytest
import torch

from lmforge.align.ppo import KLLoss, PPOConfig, PPOTrainer, ShapedKL, ppo_advantages
from lmforge.align.rollout import Rollout
from lmforge.errors import ConfigError

TINY = {"n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": 32}


def hand_rollout(old, ref, values, mask, score):
    t = torch.tensor
    mask = t(mask)
    return Rollout(
        input_ids=torch.zeros(mask.shape[0], mask.shape[1] + 1, dtype=torch.long),
        attention_mask=torch.ones(mask.shape[0], mask.shape[1] + 1, dtype=torch.long),
        completion_mask=mask, prompt_width=1, group=torch.arange(mask.shape[0]),
        rewards=t(score), old_logprobs=t(old), ref_logprobs=t(ref), values=t(values),
    )  # fmt: skip


def test_spec_gae_vector():
    """γ=λ=1, r=[0,1], V=[0.5,0.5], done=[0,1] → Â=[0.5,0.5], targets [1,1]."""
    r = hand_rollout([[-1.0, -1.0]], [[-1.0, -1.0]], [[0.5, 0.5]], [[1.0, 1.0]], [1.0])
    adv, ret, kl = ppo_advantages(r, 0.1, ShapedKL(), gamma=1.0, lam=1.0, whiten=False)
    assert adv.tolist() == [[0.5, 0.5]] and ret.tolist() == [[1.0, 1.0]]
    assert kl.abs().sum() == 0


def test_kl_shaping_by_hand():
    """KL_t = [0.1, 0.2], β = 0.5 → r = [-0.05, -0.1 + 1]; δ1 = 0.9 - 0.5 = 0.4,
    δ0 = -0.05 + 0.5 - 0.5 = -0.05; Â = [0.35, 0.4]; targets Â + V = [0.85, 0.9].
    A padded second row ends after one token and gets nothing past it."""
    r = hand_rollout(
        [[-1.0, -1.0], [-2.0, 0.0]], [[-1.1, -1.2], [-2.0, 0.0]],
        [[0.5, 0.5], [0.25, 9.0]], [[1.0, 1.0], [1.0, 0.0]], [1.0, 2.0],
    )  # fmt: skip
    adv, ret, kl = ppo_advantages(r, 0.5, ShapedKL(), gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.35, 0.4], [1.75, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.85, 0.9], [2.0, 0.0]]))
    torch.testing.assert_close(kl, torch.tensor([[0.1, 0.2], [0.0, 0.0]]))
    # PPO-KL keeps the KL out of the reward: Â = R - V with γ=λ=1
    adv, _, _ = ppo_advantages(r, 0.5, KLLoss(), gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5], [1.75, 0.0]]))


def test_kl_loss_penalty():
    logp, mask = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)
    assert KLLoss().penalty(logp, logp.clone(), mask, 0.3) == 0
    d = torch.tensor([[0.2, -0.1]])  # log π - log π_ref
    k3 = (torch.expm1(-d) + d).mean()
    torch.testing.assert_close(KLLoss().penalty(logp, logp - d, mask, 0.3), 0.3 * k3)
    assert ShapedKL().penalty(logp, logp - d, mask, 0.3) == 0


def trainer(tmp_path, **kw):
    cfg = PPOConfig(
        out_dir=str(tmp_path / "ppo"), init="scratch", model=TINY, data="task:add:1",
        n_train=40, n_eval=8, batch_size=4, minibatch_size=4, ppo_epochs=2, max_new_tokens=4,
        max_iters=2, eval_interval=2, progress=False, threads=1, **kw,
    )  # fmt: skip
    reward = lambda record, completion: float(len(completion))  # noqa: E731
    return PPOTrainer(cfg, log=lambda *a: None, reward=reward)


def test_kl_is_zero_on_the_first_rollout(tmp_path):
    stats = trainer(tmp_path).train_step()
    assert stats["kl"] == 0.0 and stats["kl_coef"] == 0.05
    assert stats["clip_frac"] == 0.0  # first minibatch is on-policy: ratio 1


def test_bad_config():
    with pytest.raises(ConfigError, match="kl_target"):
        PPOConfig(variant="kl_loss")
    with pytest.raises(ConfigError, match="critic"):
        PPOConfig(critic="twin")


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw", [{}, {"variant": "kl_loss", "kl_target": 0.1, "critic": "separate", "ent_coef": 0.01}]
)
def test_end_to_end(tmp_path, kw):
    t = trainer(tmp_path, **kw)
    result = t.run()
    out = tmp_path / "ppo"
    for name in ("model.safetensors", "critic.safetensors", "metrics.csv", "ppo.png"):
        assert (out / name).is_file(), name
    rows = (out / "metrics.csv").read_text().splitlines()
    for metric in ("reward", "kl", "entropy", "clip_frac", "value_loss"):
        values = [float(r.split(",")[-1]) for r in rows if f",train,{metric}," in r]
        assert len(values) == 2 and all(abs(v) < 1e4 for v in values), metric
    assert "reward" in result
    if kw:  # the adaptive controller moved β away from its start
        assert t.kl_ctl.value != 0.05
