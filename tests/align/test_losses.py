import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from lmforge.align.logprobs import (
    masked_mean,
    masked_whiten,
    sequence_logprobs,
    sft_loss,
    token_logprobs,
)
from lmforge.align.preference_losses import (
    bradley_terry_loss,
    dpo_loss,
    hinge_loss,
    listwise_loss,
    mse_gap_loss,
    plackett_luce_loss,
    preference_accuracy,
)
from lmforge.align.rl_losses import (
    AdaptiveKLController,
    FixedKLController,
    clipped_surrogate,
    dones_from_mask,
    entropy_from_logits,
    gae,
    group_advantages,
    grpo_loss,
    kl_per_token,
    ppo_policy_loss,
    ppo_value_loss,
    shape_rewards,
)
from lmforge.errors import ConfigError, LMForgeError

LN2 = 0.693147

# ----------------------------------------------------------------------------- log-probs, masks


def test_token_logprobs_match_log_softmax_and_ignore_index():
    logits, labels = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
    ref = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, labels), ref)
    labels[0, 1] = -100
    out = token_logprobs(logits, labels)
    assert out[0, 1] == 0 and torch.allclose(out[1], ref[1])


def test_token_logprobs_bf16_is_computed_in_fp32():
    logits, labels = torch.randn(2, 3, 50) * 10, torch.randint(0, 50, (2, 3))
    out = token_logprobs(logits.bfloat16(), labels)
    ref = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, labels[..., None])[..., 0]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref)


def test_sequence_logprobs_sums_masked_positions_only():
    logits, labels = torch.randn(2, 4, 7), torch.randint(0, 7, (2, 4))
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    lp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(sequence_logprobs(logits, labels, mask), (lp * mask).sum(-1))
    # shift convention: model logits [B, T+1] → caller passes logits[:, :-1], ids[:, 1:]
    with pytest.raises(LMForgeError, match="logits must be"):
        sequence_logprobs(logits, torch.randint(0, 7, (2, 5)), mask)


def test_masked_mean_and_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_mean(x, mask) == 2.5
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 3.5]))
    assert masked_mean(x, torch.zeros_like(mask)) == 0
    w = masked_whiten(x, mask)
    assert abs(masked_mean(w, mask)) < 1e-6
    assert abs(w[mask.bool()].std() - 1) < 1e-4  # Bessel-corrected, like TRL
    assert abs(masked_mean(masked_whiten(x, mask, shift_mean=False), mask) - 2.5) < 1e-5


# ----------------------------------------------------------------------------- reward models


def test_reward_model_losses_spec_vectors():
    zero = torch.zeros(3)
    assert abs(bradley_terry_loss(zero, zero).item() - LN2) < 1e-6
    assert abs(hinge_loss(torch.tensor([0.3]), torch.tensor([0.0])).item() - 0.7) < 1e-6
    assert hinge_loss(torch.tensor([2.0]), torch.tensor([0.0])) == 0
    assert abs(mse_gap_loss(torch.tensor([1.0]), torch.tensor([0.0]), 3.0).item() - 4.0) < 1e-6
    # margin (Llama 2) shifts the gap
    expect = -F.logsigmoid(torch.tensor(0.5 - 1.0))
    assert abs(bradley_terry_loss(torch.tensor([0.5]), torch.zeros(1), 1.0) - expect) < 1e-6


def test_listwise_and_plackett_luce():
    scores, best = torch.randn(4, 3), torch.tensor([0, 2, 1, 0])
    torch.testing.assert_close(listwise_loss(scores, best), F.cross_entropy(scores, best))
    # K=2 Plackett-Luce is Bradley-Terry
    pair = torch.randn(5, 2)
    ranking = torch.tensor([[1, 0]] * 5)
    bt = bradley_terry_loss(pair[:, 1], pair[:, 0])
    torch.testing.assert_close(plackett_luce_loss(pair, ranking), bt)
    # K=3 by hand: P(a>b>c) = e^a/(e^a+e^b+e^c) · e^b/(e^b+e^c)
    s = torch.tensor([[1.0, 2.0, 0.5]])
    a, b, c = 2.0, 1.0, 0.5
    p = (
        math.exp(a)
        / (math.exp(a) + math.exp(b) + math.exp(c))
        * math.exp(b)
        / (math.exp(b) + math.exp(c))
    )
    assert abs(plackett_luce_loss(s, torch.tensor([[1, 0, 2]])).item() + math.log(p)) < 1e-5


def test_preference_accuracy():
    acc = preference_accuracy(
        torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])
    )
    assert acc == 0.5


# ----------------------------------------------------------------------------- DPO


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_dpo_policy_equal_reference_is_ln2(beta):
    lp = torch.randn(4) * 20
    lr = torch.randn(4) * 20
    loss, rc, rr = dpo_loss(lp, lr, lp.clone(), lr.clone(), beta=beta)
    assert abs(loss.item() - LN2) < 1e-6
    assert torch.all(rc == 0) and torch.all(rr == 0)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_matches_trl_sigmoid_formula(eps):
    pc, pr, rc, rr = (torch.randn(6) * 5 for _ in range(4))
    beta = 0.2
    loss, chosen_rewards, rejected_rewards = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=eps)
    # TRL DPOTrainer, loss_type="sigmoid":
    #   logits = (pc - pr) - (rc - rr)
    #   losses = -logsigmoid(beta * logits) * (1 - label_smoothing)
    #            - logsigmoid(-beta * logits) * label_smoothing
    #   chosen_rewards = beta*(pc - rc).detach(); rejected_rewards = beta*(pr - rr).detach()
    logits = (pc - pr) - (rc - rr)
    trl = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    torch.testing.assert_close(loss, trl.mean())
    torch.testing.assert_close(chosen_rewards, beta * (pc - rc))
    torch.testing.assert_close(rejected_rewards, beta * (pr - rr))


def test_dpo_soft_labels_and_gradient_direction():
    pc, pr = torch.zeros(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    ref = torch.zeros(3)
    loss, _, _ = dpo_loss(pc, pr, ref, ref, beta=0.5)
    loss.backward()
    assert torch.all(pc.grad < 0) and torch.all(
        pr.grad > 0
    )  # descent raises chosen, lowers rejected
    # p = 0 (ε = 1) is DPO with the pair swapped; per-pair soft labels as a tensor
    a, b, c, d = (torch.randn(3) for _ in range(4))
    swapped, _, _ = dpo_loss(b, a, d, c, 0.3)
    torch.testing.assert_close(dpo_loss(a, b, c, d, 0.3, label_smoothing=1.0)[0], swapped)
    dpo_loss(a, b, c, d, 0.3, label_smoothing=torch.tensor([0.0, 0.5, 1.0]))
    with pytest.raises(ConfigError):
        dpo_loss(a, b, c, d, label_smoothing=1.5)


# ----------------------------------------------------------------------------- PPO


def test_kl_estimators():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    torch.testing.assert_close(kl_per_token(logp, ref), logp - ref)
    torch.testing.assert_close(kl_per_token(logp, ref, "k2"), 0.5 * (logp - ref) ** 2)
    k3 = torch.exp(ref - logp) - (ref - logp) - 1
    torch.testing.assert_close(kl_per_token(logp, ref, "k3"), k3)
    assert torch.all(kl_per_token(logp, ref, "k3") >= 0)
    with pytest.raises(ConfigError):
        kl_per_token(logp, ref, "k9")


def test_shape_rewards_adds_score_at_last_real_token():
    kl = torch.ones(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])  # right- and left-padded rows
    r = shape_rewards(torch.tensor([5.0, 7.0]), kl, mask, beta=0.1)
    expect = torch.tensor([[-0.1, -0.1, 4.9, 0.0], [0.0, -0.1, -0.1, 6.9]])
    torch.testing.assert_close(r, expect)
    with pytest.raises(LMForgeError, match="no real tokens"):
        shape_rewards(torch.zeros(1), torch.ones(1, 3), torch.zeros(1, 3), 0.1)


def test_gae_spec_vector():
    adv, ret = gae(
        torch.tensor([[0.0, 1.0]]),
        torch.tensor([[0.5, 0.5]]),
        torch.tensor([[0.0, 1.0]]),
        gamma=1.0,
        lam=1.0,
    )
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0]]))


def _gae_reference(r, v, d, gamma, lam, next_value):
    """Plain Python, one row, straight from the formulas."""
    T, adv, nxt_a, nxt_v = len(r), [0.0] * len(r), 0.0, next_value
    for t in reversed(range(T)):
        delta = r[t] + gamma * (1 - d[t]) * nxt_v - v[t]
        nxt_a = delta + gamma * lam * (1 - d[t]) * nxt_a
        adv[t], nxt_v = nxt_a, v[t]
    return adv


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 6),
    st.floats(0.5, 1.0),
    st.floats(0.0, 1.0),
    st.integers(0, 2**31 - 1),
)
def test_gae_matches_reference_loop(T, gamma, lam, seed):
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(3, T, generator=g), torch.randn(3, T, generator=g)
    d = (torch.rand(3, T, generator=g) < 0.3).float()
    nv = torch.randn(3, generator=g)
    adv, ret = gae(r, v, d, gamma, lam, next_value=nv)
    for b in range(3):
        ref = _gae_reference(r[b].tolist(), v[b].tolist(), d[b].tolist(), gamma, lam, nv[b].item())
        torch.testing.assert_close(adv[b], torch.tensor(ref), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, adv + v)


def test_gae_with_mask_dones_gives_reward_to_go():
    mask = torch.tensor([[1, 1, 1, 0]])
    dones = dones_from_mask(mask)
    torch.testing.assert_close(dones, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    rewards = torch.tensor([[1.0, 2.0, 3.0, 99.0]])  # the padded reward must not leak backwards
    _, ret = gae(rewards, torch.randn(1, 4), dones, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret[:, :3], torch.tensor([[6.0, 5.0, 3.0]]))


def test_clipped_surrogate_spec_vectors():
    out = clipped_surrogate(torch.tensor([1.5, 0.5]), torch.tensor([1.0, -1.0]), 0.2)
    torch.testing.assert_close(out, torch.tensor([1.2, -0.8]))


def test_ppo_policy_loss():
    logp = torch.randn(2, 3, requires_grad=True)
    adv, mask = torch.randn(2, 3), torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, stats = ppo_policy_loss(logp, logp.detach(), adv, mask)
    torch.testing.assert_close(loss, -masked_mean(adv, mask))
    assert stats["clip_frac"] == 0 and stats["approx_kl"] == 0
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * mask / 5)
    # far off-policy with positive advantage: every token clipped, no gradient
    logp2 = torch.zeros(1, 2, requires_grad=True)
    loss, stats = ppo_policy_loss(
        logp2, torch.full((1, 2), -1.0), torch.ones(1, 2), torch.ones(1, 2)
    )
    loss.backward()
    assert stats["clip_frac"] == 1 and abs(loss.item() + 1.2) < 1e-6
    assert torch.all(logp2.grad == 0)
    assert abs(stats["approx_kl"].item() - 0.5) < 1e-6


def test_ppo_value_loss_clipped_and_unclipped():
    v, old, ret = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[3.0, 1.0]])
    mask = torch.ones(1, 2)
    assert abs(ppo_value_loss(v, old, ret, mask).item() - 0.5 * (1 + 1) / 2) < 1e-6
    # clipped: V_clip = 0.2 → (0.2 - 3)² = 7.84 > 1 for the first token
    assert (
        abs(ppo_value_loss(v, old, ret, mask, clip_range=0.2).item() - 0.5 * (7.84 + 1) / 2) < 1e-5
    )


def test_entropy_from_logits():
    ent = entropy_from_logits(torch.zeros(2, 3, 8))
    torch.testing.assert_close(ent, torch.full((2, 3), math.log(8)))
    logits = torch.randn(2, 3, 5)
    p = logits.softmax(-1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    mask = torch.tensor([[1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(entropy_from_logits(logits, mask), -(p * p.log()).sum(-1)[0, 0])


def test_kl_controllers():
    fixed = FixedKLController(0.1)
    fixed.update(10.0, 100)
    assert fixed.value == 0.1
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(6.6, 256)  # error 0.1
    assert abs(ctl.value - 0.1 * (1 + 0.1 * 256 / 10000)) < 1e-12
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(60.0, 10000)  # error clipped to 0.2
    assert abs(ctl.value - 0.12) < 1e-12
    ctl.update(0.0, 10000)  # clipped to -0.2
    assert abs(ctl.value - 0.096) < 1e-12
    with pytest.raises(ConfigError):
        AdaptiveKLController(0.1, target=0.0, horizon=1)


# ----------------------------------------------------------------------------- GRPO


def test_group_advantages_spec_vectors():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=4, scale="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.all(group_advantages(torch.full((2, 4), 3.0)) == 0)
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]])
    # TRL: (r - mean) / (std + 1e-4), std Bessel-corrected
    expect = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    torch.testing.assert_close(group_advantages(r), expect)
    torch.testing.assert_close(group_advantages(r.flatten(), group_size=4), expect.flatten())
    with pytest.raises(ConfigError):
        group_advantages(torch.zeros(6), group_size=4)


def test_grpo_equal_rewards_give_zero_gradient():
    logp = torch.randn(4, 5, requires_grad=True)
    adv = group_advantages(torch.ones(4), group_size=4)
    loss, _ = grpo_loss(logp, None, logp.detach(), adv, torch.ones(4, 5), beta=0.04)
    loss.backward()
    assert torch.all(logp.grad == 0)


def test_grpo_on_policy_gradient_is_minus_advantage_grad_logp():
    logp = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -2.0])
    loss, stats = grpo_loss(logp, logp.detach(), None, adv, mask)
    loss.backward()
    # per-sequence token mean, then mean over the 2 sequences
    n = mask.sum(1, keepdim=True)
    torch.testing.assert_close(logp.grad, -adv[:, None] * mask / n / 2)
    assert stats["kl"] == 0


def test_grpo_kl_term_is_k3():
    logp, ref = torch.randn(1, 3), torch.randn(1, 3)
    loss, stats = grpo_loss(logp, None, ref, torch.zeros(1), torch.ones(1, 3), beta=0.5)
    k3 = (torch.exp(ref - logp) - (ref - logp) - 1).mean()
    torch.testing.assert_close(loss, 0.5 * k3)
    torch.testing.assert_close(stats["kl"], k3)


# ----------------------------------------------------------------------------- SFT


def test_sft_loss_ignores_prompt_logits_and_shifts():
    logits = torch.randn(2, 6, 11)
    ids = torch.randint(0, 11, (2, 6))
    labels = ids.clone()
    labels[:, :3] = -100  # prompt
    loss = sft_loss(logits, labels)
    # logits at positions 0, 1 predict prompt tokens 1, 2: changing them changes nothing
    changed = logits.clone()
    changed[:, :2] = torch.randn(2, 2, 11) * 100
    torch.testing.assert_close(sft_loss(changed, labels), loss)
    manual = F.cross_entropy(logits[:, 2:5].reshape(-1, 11), ids[:, 3:].reshape(-1))
    torch.testing.assert_close(loss, manual)
    smooth = F.cross_entropy(
        logits[:, 2:5].reshape(-1, 11), ids[:, 3:].reshape(-1), label_smoothing=0.1
    )
    torch.testing.assert_close(sft_loss(logits, labels, label_smoothing=0.1), smooth)


def test_sft_loss_with_no_response_tokens_is_zero_and_backpropagates():
    logits = torch.randn(1, 4, 5, requires_grad=True)
    loss = sft_loss(logits, torch.full((1, 4), -100))
    loss.backward()
    assert loss == 0 and torch.all(logits.grad == 0)


def test_ppo_policy_loss_accepts_one_advantage_per_sequence():
    logp, old = torch.randn(2, 3), torch.randn(2, 3)
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, -1.0])
    loss, _ = ppo_policy_loss(logp, old, adv, mask)
    torch.testing.assert_close(loss, ppo_policy_loss(logp, old, adv[:, None].expand(2, 3), mask)[0])
