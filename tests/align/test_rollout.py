"""Rollout engine: exact re-scoring of sampled completions, masks, KL = 0 against an identical
reference, and rewards that fail loudly with the sample."""

import math

import pytest
import torch

from lmforge.align.rl_losses import kl_per_token
from lmforge.align.rollout import (
    ModelReward,
    RewardError,
    RolloutEngine,
    ValueHead,
    VerifierReward,
    completion_logprobs,
    default_stop_ids,
)
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tasks.synthetic import ALPHABET
from lmforge.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def lm():
    tok = Tokenizer.train_char([ALPHABET])
    cfg = ModelConfig(vocab_size=tok.vocab_size, n_layer=2, n_head=2, d_model=32, max_seq_len=48)
    return LM.from_config(cfg, tok, seed=0)


def engine(lm, **kw):
    return RolloutEngine(lm.model, lm.tokenizer, max_new_tokens=6, **kw)


RECORDS = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "13+22=", "answer": "35"}]


def sample(lm, eng, n=3, seed=0):
    ids = [lm.tokenizer.encode(r["prompt"]) for r in RECORDS]
    return eng.sample(ids, RECORDS, n=n, seed=seed)


def test_layout_and_masks(lm):
    r = sample(lm, engine(lm))
    assert len(r) == 6 and r.group.tolist() == [0, 0, 0, 1, 1, 1]
    assert r.input_ids.shape[1] == r.prompt_width + r.completion_mask.shape[1]
    assert r.prompt_width == len("13+22=")
    # completion tokens are exactly the non-padding positions after the prompt
    assert torch.equal(r.attention_mask[:, r.prompt_width :].float(), r.completion_mask)
    stops = set(default_stop_ids(lm.tokenizer))
    for row, length in enumerate(r.lengths.long().tolist()):
        tokens = r.completion_ids[row, :length].tolist()
        assert length == 6 or tokens[-1] in stops  # stop token ends a row, else the budget
        assert not stops & set(tokens[:-1])
    assert [rec["answer"] for rec in r.records] == ["3"] * 3 + ["35"] * 3


def test_logprobs_equal_unpadded_scoring(lm):
    """Left-padded prompt + right-padded completion scores like the row on its own."""
    r = sample(lm, engine(lm), seed=3)
    for row in range(len(r)):
        ids = r.input_ids[row][r.attention_mask[row].bool()][None]
        n = int(r.completion_mask[row].sum())
        alone = completion_logprobs(lm.model, ids, torch.ones_like(ids), ids.shape[1] - n)
        torch.testing.assert_close(r.old_logprobs[row, :n], alone[0], atol=1e-5, rtol=1e-5)
        assert (r.old_logprobs[row, n:] == 0).all()


def test_kl_zero_when_reference_is_policy(lm):
    import copy

    ref = copy.deepcopy(lm.model).requires_grad_(False)
    r = sample(lm, engine(lm, reference=ref))
    kl = kl_per_token(r.old_logprobs, r.ref_logprobs, "k3") * r.completion_mask
    assert kl.abs().max().item() == 0.0


def test_values_and_minibatches(lm):
    head = ValueHead(32)
    torch.nn.init.normal_(head.proj.weight)
    eng = engine(lm, value_fn=lambda h, r: head(h))
    r = sample(lm, eng)
    assert r.values.shape == r.completion_mask.shape
    assert (r.values[r.completion_mask == 0] == 0).all() and r.values.abs().sum() > 0
    rows = []
    for mb in r.minibatches(4, torch.Generator().manual_seed(0)):
        assert mb.prompt_width == r.prompt_width and len(mb.records) == len(mb) <= 4
        rows += [tuple(x.tolist()) + (v,) for x, v in zip(mb.input_ids, mb.values.sum(-1))]
    full = [tuple(x.tolist()) + (v,) for x, v in zip(r.input_ids, r.values.sum(-1))]
    assert sorted(rows) == sorted(full)  # every row exactly once, values travel with it


def test_verifier_reward_scores_and_greedy(lm):
    r = engine(lm).sample([lm.tokenizer.encode("1+2=")], [RECORDS[0]], greedy=True)
    assert r.old_logprobs is None  # greedy evaluation skips the scoring passes
    hit = VerifierReward(lambda rec, c: c.strip() == rec["answer"])
    assert hit(r).tolist() == [float(r.completions[0].strip() == "3")]


def test_reward_that_raises_names_the_sample(lm):
    r = sample(lm, engine(lm))

    def broken(record, completion):
        raise KeyError("no answer")

    with pytest.raises(RewardError, match=r"broken raised KeyError.*sample 0.*'1\+2='"):
        VerifierReward(broken)(r)


def test_nan_reward_is_reported_not_zeroed(lm):
    r = sample(lm, engine(lm))
    nan_on_second = lambda rec, c: math.nan if rec["answer"] == "35" else 1.0  # noqa: E731
    with pytest.raises(RewardError, match=r"nan for sample 3 of 6.*'13\+22='.*completion"):
        VerifierReward(nan_on_second, name="checker")(r)


def test_model_reward_checks_outputs(lm):
    r = sample(lm, engine(lm))
    scores = ModelReward(lambda ids, mask: mask.sum(-1).float())(r)
    assert torch.equal(scores, r.attention_mask.sum(-1).float())
    with pytest.raises(RewardError, match="inf for sample 0"):
        ModelReward(lambda ids, mask: torch.full((len(ids),), math.inf))(r)
    with pytest.raises(RewardError, match="returned 1 scores for 6 samples"):
        ModelReward(lambda ids, mask: torch.zeros(1))(r)


def test_greedy_rollout_matches_lm_generate(lm):
    """RL evaluation decodes exactly what SFT's exact_match sees (same prompts, same tokens)."""
    pairs = [(1, 2), (13, 22), (7, 85)]
    records = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    ids = [lm.tokenizer.encode(r["prompt"]) for r in records]
    r = engine(lm).sample(ids, records, greedy=True)
    expected = lm.generate(ids, max_new_tokens=6, temperature=0.0)
    assert r.completions == lm.tokenizer.decode_batch(expected, skip_special_tokens=True)
    for row, tokens in enumerate(expected):
        assert r.completion_ids[row, : len(tokens)].tolist() == tokens
        assert r.lengths[row].item() == len(tokens)
