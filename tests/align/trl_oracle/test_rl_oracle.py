"""TRL is the oracle for the RL losses: GRPO (every loss_type, KL form, clip-higher, overlong
filtering) and RLOO, from TRL's own advantage and log-prob code (see trl_oracle_common.py).

GRPO advantages: lmforge's ``scale: std`` is TRL's ``scale_rewards="group"`` and ``none`` is
``"none"``; TRL's ``"batch"`` is not offered.
"""

import copy
from types import SimpleNamespace

import pytest
import torch
import trl
from datasets import Dataset
from trl_oracle_common import EOS, TOL, LMForgeView, assert_same, perturb, trl_args

from lmforge.align import grpo as lm_grpo
from lmforge.align.rollout import Rollout, completion_logprobs

pytestmark = pytest.mark.filterwarnings("ignore")


# ----------------------------------------------------------------------------- GRPO / RLOO

# Two prompts x two completions; rows 1 and 3 hit max_completion_length (4) without EOS.
PROMPTS = [[5, 6], [5, 6], [7, 8], [7, 8]]
COMPLETIONS = [[9, 10, EOS], [11, 12, 13, 14], [15, EOS], [16, 17, 18, 19]]
REWARDS = [1.0, 0.0, 0.5, 0.25]


def rollout_from(trainer_out: dict, rewards: list[float]) -> Rollout:
    """lmforge's Rollout layout of the same prompts/completions TRL padded (prompt | completion)."""
    lengths = torch.tensor([len(c) for c in COMPLETIONS])
    width = trainer_out["completion_ids"].shape[1]
    completion_mask = (torch.arange(width) < lengths[:, None]).float()  # before any filtering
    prompt_ids, prompt_mask = trainer_out["prompt_ids"], trainer_out["prompt_mask"]
    return Rollout(
        input_ids=torch.cat([prompt_ids, trainer_out["completion_ids"]], 1),
        attention_mask=torch.cat([prompt_mask, completion_mask.long()], 1),
        completion_mask=completion_mask,
        prompt_width=prompt_ids.shape[1],
        group=torch.tensor([0, 0, 1, 1]),
        rewards=torch.tensor(rewards),
    )


def scripted(trainer, rloo: bool = False) -> None:
    """Replace TRL's sampling by the fixed completions above; everything after it is TRL's."""
    texts = ["x"] * len(PROMPTS)
    if rloo:  # RLOO's _generate returns (prompt_ids, completion_ids, completions)
        trainer._generate = lambda prompts: (PROMPTS, COMPLETIONS, texts)
    else:  # GRPO's also returns tool masks, sampling log-probs, extra fields and images
        out = (PROMPTS, COMPLETIONS, None, texts, None, {}, None, None)
        trainer._generate = lambda prompts: out


@pytest.mark.parametrize(
    "loss_type,beta,kl_correction,eps_high,mask_trunc,scale",
    [
        ("grpo", 0.05, False, None, False, "std"),
        ("grpo", 0.05, True, None, False, "std"),
        ("bnpo", 0.0, False, None, False, "std"),
        ("dr_grpo", 0.05, True, None, False, "none"),
        ("dapo", 0.0, False, 0.28, True, "std"),
        ("dapo", 0.05, False, 0.28, False, "std"),
        ("grpo", 0.0, False, 0.28, True, "none"),
    ],
)
def test_grpo_loss_types_match_trl(
    tok, model_dir, loss_type, beta, kl_correction, eps_high, mask_trunc, scale
):
    """TRL GRPOTrainer._generate_and_score_completions (advantages, overlong filtering, π_old and
    π_ref log-probs) + _compute_loss, after one off-policy weight change so ratios leave 1 and
    clipping (incl. clip-higher) acts, = lmforge GRPOTrainer.prepare + minibatch_loss.

    KL: lmforge's default is DeepSeekMath's β·k3 (TRL's ``use_bias_correction_kl=False``);
    ``kl_correction: true`` is TRL 1.x's default k3·ratio (see ``losses.grpo_loss``)."""
    args = trl_args(trl.GRPOConfig, per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=4, beta=beta, num_iterations=2, loss_type=loss_type,
                    epsilon=0.2, epsilon_high=eps_high, mask_truncated_completions=mask_trunc,
                    scale_rewards={"std": "group", "none": "none"}[scale],
                    use_bias_correction_kl=kl_correction)  # fmt: skip
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **_: REWARDS,
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
                              processing_class=tok)  # fmt: skip
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    policy = trainer.model
    ref = copy.deepcopy(policy).requires_grad_(False)  # = TRL's ref (same checkpoint)
    scripted(trainer)
    trl_inputs = trainer._generate_and_score_completions([{"prompt": p} for p in "aabb"])

    cfg = lm_grpo.GRPOConfig(group_size=2, beta=beta, clip_eps=0.2, clip_eps_high=eps_high,
                             loss_type=loss_type, mask_truncated=mask_trunc, scale=scale,
                             num_iterations=2, max_new_tokens=4,
                             kl_correction=kl_correction)  # fmt: skip
    ours = SimpleNamespace(lm=SimpleNamespace(model=LMForgeView(policy)), cfg=cfg,
                           engine=SimpleNamespace(stop_ids=[EOS]))  # fmt: skip
    rollout = rollout_from(trl_inputs, REWARDS)
    args4 = (rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
    with torch.no_grad():  # what lmforge's RolloutEngine stores at sampling time
        rollout.old_logprobs = completion_logprobs(LMForgeView(policy), *args4)
        rollout.ref_logprobs = completion_logprobs(LMForgeView(ref), *args4)
    lm_grpo.GRPOTrainer.prepare(ours, rollout)
    torch.testing.assert_close(rollout.advantages, trl_inputs["advantages"], atol=TOL, rtol=0)
    torch.testing.assert_close(rollout.completion_mask, trl_inputs["completion_mask"].float())

    perturb(policy, 0.3, seed=3)  # "after an optimizer step": π ≠ π_old
    policy.train()
    assert_same(
        policy,
        lambda: trainer._compute_loss(policy, trl_inputs),
        lambda: lm_grpo.GRPOTrainer.minibatch_loss(ours, rollout)[0],
    )
    stats = lm_grpo.GRPOTrainer.minibatch_loss(ours, rollout)[1]
    assert stats["clip_frac"] > 0  # the clipped branch was exercised


@pytest.mark.parametrize("beta,normalize", [(0.0, False), (0.1, True)])
def test_rloo_matches_trl(tok, model_dir, beta, normalize):
    """TRL RLOOTrainer (leave-one-out advantages with the k1 KL charged to the reward, optional
    whitening; sequence-level clipped ratio) = lmforge GRPOTrainer with loss_type rloo."""
    args = trl_args(trl.RLOOConfig, per_device_train_batch_size=4, num_generations=2,
                    max_completion_length=4, beta=beta, num_iterations=2, epsilon=0.2,
                    normalize_advantages=normalize)  # fmt: skip
    trainer = trl.RLOOTrainer(model=model_dir, reward_funcs=lambda completions, **_: REWARDS,
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}),
                              processing_class=tok)  # fmt: skip
    policy = trainer.model
    ref = copy.deepcopy(policy).requires_grad_(False)
    perturb(ref, 0.05, seed=4)  # TRL's ref is the checkpoint; make ours, and TRL's, differ from π
    if trainer.ref_model is not None:
        trainer.ref_model.load_state_dict(ref.state_dict())
    scripted(trainer, rloo=True)
    trl_inputs = trainer._generate_and_score_completions([{"prompt": p} for p in "aabb"])

    cfg = lm_grpo.GRPOConfig(group_size=2, beta=beta, clip_eps=0.2, loss_type="rloo",
                             normalize_advantages=normalize, num_iterations=2,
                             max_new_tokens=4)  # fmt: skip
    ours = SimpleNamespace(lm=SimpleNamespace(model=LMForgeView(policy)), cfg=cfg,
                           engine=SimpleNamespace(stop_ids=[EOS]))  # fmt: skip
    rollout = rollout_from(trl_inputs, REWARDS)
    args4 = (rollout.input_ids, rollout.attention_mask, rollout.prompt_width)
    with torch.no_grad():
        rollout.old_logprobs = completion_logprobs(LMForgeView(policy), *args4)
        rollout.ref_logprobs = completion_logprobs(LMForgeView(ref), *args4)
    lm_grpo.GRPOTrainer.prepare(ours, rollout)
    torch.testing.assert_close(rollout.advantages, trl_inputs["advantages"], atol=TOL, rtol=0)

    perturb(policy, 0.05, seed=5)
    policy.train()
    assert_same(
        policy,
        lambda: trainer._compute_loss(policy, trl_inputs),
        lambda: lm_grpo.GRPOTrainer.minibatch_loss(ours, rollout)[0],
    )
