"""GRPO wiring: group advantages on a worked example (DeepSeekMath), equal rewards give no
update, and a short end-to-end run on a tiny model writes a checkpoint, metrics and a plot."""

import pytest
import torch

from lmforge.align.grpo import GRPOConfig, GRPOTrainer
from lmforge.align.rl_losses import group_advantages
from lmforge.align.rollout import completion_logprobs
from lmforge.errors import ConfigError
from lmforge.lm import LM
from lmforge.model.config import ModelConfig

TINY = {"n_layer": 1, "n_head": 2, "d_model": 16, "max_seq_len": 32}


def trainer(tmp_path, reward=None, **kw):
    base = dict(
        out_dir=str(tmp_path / "grpo"), init="scratch", model=TINY, data="task:add:1",
        n_train=40, n_eval=8, batch_size=2, group_size=4, max_new_tokens=4, max_iters=2,
        eval_interval=2, progress=False, threads=1,
    )  # fmt: skip
    cfg = GRPOConfig(**{**base, **kw})
    return GRPOTrainer(cfg, log=lambda *a: None, reward=reward)


def test_spec_advantages():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, scale="none")
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_equal_rewards_leave_the_policy_unchanged(tmp_path):
    t = trainer(tmp_path, reward=lambda record, completion: 1.0, lr=1e-2)
    before = {n: p.clone() for n, p in t.lm.model.named_parameters()}
    stats = t.train_step()
    assert stats["reward"] == 1.0 and stats["frac_zero_std"] == 1.0
    for n, p in t.lm.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_update_favours_rewarded_completions(tmp_path):
    """One plain SGD step raises log π of the rewarded completion above its group's others."""
    t = trainer(tmp_path)
    t.optimizer = torch.optim.SGD(t.lm.model.parameters(), lr=0.5)
    t.cfg.optim.grad_clip = 0.0
    t.cfg.batch_size = 4
    rollout = t.rollout([0, 1, 2, 3])
    rollout.rewards = torch.tensor([1.0, 0, 0, 0] * 4)  # the first of each group is "right"

    def seq_logp():
        with torch.no_grad():
            lp = completion_logprobs(
                t.lm.model, rollout.input_ids, rollout.attention_mask, rollout.prompt_width
            )
        return (lp * rollout.completion_mask).sum(-1).view(4, 4)

    before = seq_logp()
    t.update(rollout)
    delta = seq_logp() - before
    assert (delta[:, 0] > delta[:, 1:].max(-1).values).all()


def test_bad_config():
    with pytest.raises(ConfigError, match="group_size >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ConfigError, match="scale"):
        GRPOConfig(scale="rank")


def lower_first(record, completion):
    """A dense stand-in verifier: right when the completion starts with a lowercase letter (about
    30% of a random char-level policy's samples, so almost every group has signal)."""
    return float(completion[:1].islower())


def test_end_to_end_raises_the_reward(tmp_path):
    """8 steps with the KL term, μ = 2 and minibatches: the policy's mean reward on held-out
    prompts (16 samples each, same sampling seed before and after) rises by well over chance
    noise, and the run writes a checkpoint, metrics and a plot."""
    t = trainer(tmp_path, reward=lower_first, beta=0.04, num_iterations=2, minibatch_size=16,
                batch_size=4, group_size=8, max_iters=8, eval_interval=8, lr=2e-2)  # fmt: skip

    def held_out_reward() -> float:
        rollout = t.engine.sample(t.eval_prompts, t.eval_records, n=16, seed=5,
                                  keep_logprobs=False)  # fmt: skip
        return t.reward(rollout).mean().item()

    before = held_out_reward()
    t.run()
    after = held_out_reward()
    assert after > before + 0.2, (before, after)  # measured 0.30 -> 0.66
    out = tmp_path / "grpo"
    for name in ("model.safetensors", "config.json", "metrics.csv", "grpo.png"):
        assert (out / name).is_file(), name
    rows = (out / "metrics.csv").read_text().splitlines()
    losses = [float(r.split(",")[-1]) for r in rows if ",train,loss," in r]
    assert len(losses) == 8 and any(",train,kl," in r for r in rows)
    saved = LM.load(out)
    x = torch.tensor([t.prompts[0]])
    torch.testing.assert_close(saved.model(x), t.lm.model.eval()(x))  # the trained policy


def test_positive_only_gradient_is_the_sft_gradient(tmp_path):
    """With every advantage 1 the on-policy GRPO loss is the SFT loss on the sampled completions
    (per-sequence token means), so RL formatting (left padding, positions, the stop token) trains
    exactly the tokens SFT would."""
    from lmforge.align import data as D
    from lmforge.align.logprobs import sft_loss
    from lmforge.align.rl_losses import grpo_loss

    t = trainer(tmp_path)
    model = t.lm.model
    rollout = t.rollout([0, 1])
    keep = [i for i in range(len(rollout)) if rollout.lengths[i] > 0]
    rollout = rollout.select(keep)
    logp = completion_logprobs(
        model, rollout.input_ids, rollout.attention_mask, rollout.prompt_width
    )
    ones = torch.ones(len(rollout))
    loss_rl, _ = grpo_loss(logp, None, None, ones, rollout.completion_mask, 0.2, 0.0)
    grads_rl = torch.autograd.grad(loss_rl, list(model.parameters()))
    grads_sft = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(rollout)):  # one sequence at a time: SFT's token mean = GRPO's per row
        tokens = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        prompt = t.prompts[rollout.group[i].item()]
        ex = D.SFTExample(prompt + tokens, [-100] * len(prompt) + tokens)
        batch = D.collate_sft([ex], t.pad_id)
        loss = sft_loss(model(batch["input_ids"]), batch["labels"]) / len(rollout)
        for g, gi in zip(grads_sft, torch.autograd.grad(loss, list(model.parameters()))):
            g += gi
    for (name, _), a, b in zip(model.named_parameters(), grads_rl, grads_sft):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("logit_scaling", [False, True])
def test_scored_logprobs_are_the_samplers(logit_scaling):
    """The update's log-probs are those of the forward pass the sampler drew from (with the
    1/sqrt(d_model) logit scaling too), so on-policy ratios start at exactly 1."""
    config = ModelConfig.from_dict({**TINY, "vocab_size": 20, "logit_scaling": logit_scaling})
    model = LM.from_config(config, seed=0).model
    ids = torch.randint(0, 20, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logp = completion_logprobs(model, ids, mask, 4)
        full = torch.log_softmax(model(ids, attention_mask=mask)[:, 3:-1], -1)
    torch.testing.assert_close(logp, full.gather(-1, ids[:, 4:, None])[..., 0])
