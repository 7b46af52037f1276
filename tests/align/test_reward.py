"""Reward model: pooling, left/right padding equality, losses, save/load, trainer."""

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch

from lmforge.align import data as D
from lmforge.align.logprobs import last_index
from lmforge.align.reward import (
    POOLING,
    RewardConfig,
    RewardModel,
    RewardTrainer,
    policy_pairs,
)
from lmforge.align.trainer import load_lm
from lmforge.errors import ConfigError, DataError

TINY = {"n_layer": 2, "d_model": 32, "n_head": 2}


@pytest.fixture(scope="module")
def lm():
    return load_lm("scratch", TINY, 32, 0, "cpu")


def padded(rows, pad, side):
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[i, sl], mask[i, sl] = torch.tensor(r), 1
    return ids, mask


@pytest.mark.parametrize("pooling", list(POOLING))
def test_left_and_right_padding_give_the_same_reward(lm, pooling):
    tok = lm.tokenizer
    rm = RewardModel(lm.model, pooling, tok.eos_id).eval()
    rows = [tok.encode("12+34=46") + [tok.eos_id], tok.encode("1+1=2") + [tok.eos_id],
            tok.encode("7*8=56")]  # fmt: skip
    right = rm(*padded(rows, tok.pad_id, "right"))
    left = rm(*padded(rows, tok.pad_id, "left"))
    alone = torch.stack([rm(torch.tensor([r])) for r in rows]).squeeze(-1)
    assert torch.allclose(right, left, atol=1e-5)
    assert torch.allclose(right, alone, atol=1e-5)


def test_pooling_vectors():
    h = torch.arange(12.0).view(1, 4, 3).repeat(2, 1, 1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    ids = torch.tensor([[5, 9, 5, 0], [0, 9, 4, 5]])
    assert last_index(mask).tolist() == [2, 3]
    assert POOLING["last"](h, mask, ids, None)[0].tolist() == [6.0, 7.0, 8.0]
    assert POOLING["mean"](h, mask, ids, None)[1].tolist() == [6.0, 7.0, 8.0]  # rows 1..3
    eos = POOLING["eos"](h, mask, ids, SimpleNamespace(eos_id=9))  # the last EOS, wherever
    assert eos[0].tolist() == [3.0, 4.0, 5.0] and eos[1].tolist() == [3.0, 4.0, 5.0]


def test_match_pooling_sums_to_the_logits_of_the_actual_next_tokens(lm):
    """Summed over d_model, `match` pooling is the mean logit the LM gave each real next token."""
    tok = lm.tokenizer
    rm = RewardModel(lm.model, "match", tok.eos_id).eval()
    rows = [tok.encode("12+34=46") + [tok.eos_id], tok.encode("1+1=2")]
    ids, mask = padded(rows, tok.pad_id, "right")
    with torch.no_grad():
        h = lm.model.norm(lm.model.hidden_states(ids, mask))
        pooled = POOLING["match"](h, mask, ids, rm)
        for i, r in enumerate(rows):
            logits = lm.model(torch.tensor([r]))[0]
            want = torch.stack([logits[t - 1, r[t]] for t in range(1, len(r))]).mean()
            assert pooled[i].sum().item() == pytest.approx(want.item(), abs=1e-4)


def test_lm_weight_adds_the_chosen_next_token_loss(tmp_path):
    from lmforge.align.logprobs import sft_loss

    cfg = RewardConfig(out_dir=str(tmp_path), model=TINY, max_len=24, n_train=16, n_eval=8,
                       batch_size=4, max_iters=1, progress=False, lm_weight=0.5)  # fmt: skip
    t = RewardTrainer(cfg, log=lambda *a: None)
    b = t.batch([0, 1, 2, 3])
    with torch.no_grad():
        total, stats = t.loss(b)
        t.cfg.lm_weight = 0.0
        plain, _ = t.loss(b)
        lm_loss = sft_loss(t.lm.model(b["input_ids"][:4]), b["labels"][:4])  # chosen rows only
    assert stats["lm_loss"] == pytest.approx(lm_loss.item(), rel=1e-4)
    assert total.item() == pytest.approx(plain.item() + 0.5 * lm_loss.item(), rel=1e-4)


def test_save_and_load_roundtrip(lm, tmp_path):
    rm = RewardModel(lm.model, "mean", lm.tokenizer.eos_id)
    rm.save(tmp_path, lm.tokenizer)
    back, tok = RewardModel.load(tmp_path)
    texts = ["1+1=2", "12+3=15"]
    assert back.pooling == "mean" and tok is not None
    assert torch.allclose(back.score(texts, tok), rm.eval().score(texts, lm.tokenizer), atol=1e-6)
    assert (tmp_path / "reward_head.safetensors").is_file()


def test_bad_pooling_or_loss():
    with pytest.raises(ConfigError, match="pooling"):
        RewardConfig(pooling="max")
    with pytest.raises(ConfigError, match="loss"):
        RewardConfig(loss="nope")


def letter_pairs(n: int, seed: int) -> list[dict]:
    """Preference pairs with a rule a tiny model learns in a few steps: the chosen response is
    drawn from a-m, the rejected one (same length) from n-z. Different seeds give new strings."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(3, 5)
        chosen = "".join(rng.choice("abcdefghijklm") for _ in range(k))
        rejected = "".join(rng.choice("nopqrstuvwxyz") for _ in range(k))
        out.append({"prompt": "say:", "chosen": chosen, "rejected": rejected})
    return out


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("loss", ["bt", "hinge", "mse", "listwise"])
def test_reward_trainer_learns_to_rank_held_out_pairs(tmp_path, loss):
    """20 steps on 64 pairs: the saved reward model ranks held-out chosen responses (strings
    never seen in training) above rejected ones, scored here independently of the trainer."""
    pooling = "match" if loss == "hinge" else "last"
    held_out = letter_pairs(32, seed=1)
    cfg = RewardConfig(out_dir=str(tmp_path), model=TINY, max_len=24, n_train=64, n_eval=32,
                       data=write_jsonl(tmp_path / "train.jsonl", letter_pairs(64, seed=0)),
                       eval_data=write_jsonl(tmp_path / "eval.jsonl", held_out),
                       batch_size=8, max_iters=20, eval_interval=20, progress=False, threads=1,
                       loss=loss, warmup_iters=1, pooling=pooling, lr=3e-3)  # fmt: skip
    t = RewardTrainer(cfg, log=lambda *a: None)
    if loss == "bt":  # Bradley-Terry: equal rewards give ln 2
        b = t.batch([0, 1])
        with torch.no_grad():
            weight = t.rm.head.weight.clone()
            t.rm.head.weight.zero_()
            assert t.loss(b)[0].item() == pytest.approx(math.log(2), abs=1e-6)
            t.rm.head.weight.copy_(weight)
    with torch.no_grad():
        before = t.evaluate()["accuracy"]
    r = t.run()
    rm, tok = RewardModel.load(tmp_path)
    chosen = rm.score([p["prompt"] + p["chosen"] for p in held_out], tok)
    rejected = rm.score([p["prompt"] + p["rejected"] for p in held_out], tok)
    accuracy = (chosen > rejected).float().mean().item()
    assert before < 0.75 and accuracy >= 0.9  # chance is 0.5; untrained it is at most 0.75
    assert r["accuracy"] == pytest.approx(accuracy)
    assert (tmp_path / "reward.png").is_file() and (tmp_path / "reward_config.json").is_file()


def test_preference_batch_rewards_split(lm):
    ex = D.encode_preference({"prompt": "1+1=", "chosen": "2", "rejected": "3"}, lm.tokenizer, 16)
    b = D.collate_preferences([ex, ex], lm.tokenizer.pad_id)
    r = RewardModel(lm.model)(b["input_ids"], b["attention_mask"])
    assert r.shape == (4,)


# ----------------------------------------------------------------------------- on-policy pairs


def odd_first(record, completion):  # a stand-in verifier: right when the answer starts odd
    return float(completion[:1] in "13579" and completion[:1] != "")


def test_policy_pairs_pair_a_right_sample_with_a_wrong_one(lm):
    tok = lm.tokenizer
    records = D.load_prompts("task:add:1", n=12, seed=0)
    pairs, unpaired = policy_pairs(lm.model, tok, records, samples=16, pairs_per_prompt=2,
                                   max_new_tokens=3, judge=odd_first)  # fmt: skip
    assert pairs.examples and 0 <= unpaired < len(records)
    for e in pairs.examples:
        n = e.chosen.prompt_len
        assert n == e.rejected.prompt_len and e.chosen.input_ids[:n] == e.rejected.input_ids[:n]
        assert e.chosen.labels[n:] == e.chosen.input_ids[n:]  # completion trained, prompt not
        right, wrong = (tok.decode(x.input_ids[n:], skip_special_tokens=True)
                        for x in (e.chosen, e.rejected))  # fmt: skip
        assert odd_first({}, right) == 1.0 and odd_first({}, wrong) == 0.0
        assert e.chosen.input_ids != e.rejected.input_ids
    assert len(pairs.examples) <= 2 * len(records)
    with pytest.raises(DataError, match="no on-policy pairs"):  # all samples right: no pairs
        policy_pairs(lm.model, tok, records[:2], samples=4, judge=lambda r, c: 1.0)


def test_policy_pairs_keep_the_sampled_token_ids(lm):
    """The pairs hold exactly the ids the sampler drew (stop token included): what PPO scores."""
    from lmforge.align.rollout import RolloutEngine

    tok = lm.tokenizer
    records = D.load_prompts("task:add:1", n=4, seed=0)
    prompts = [D.prompt_ids(r, tok) for r in records]
    rollout = RolloutEngine(lm.model, tok, 3, 1.0).sample(prompts, records, 16, 0, False)
    sampled = {tuple(rollout.input_ids[i][rollout.attention_mask[i] == 1].tolist())
               for i in range(len(rollout))}  # fmt: skip
    pairs, _ = policy_pairs(lm.model, tok, records, samples=16, max_new_tokens=3, judge=odd_first)
    for e in pairs.examples:
        assert tuple(e.chosen.input_ids) in sampled and tuple(e.rejected.input_ids) in sampled


def test_policy_pairs_reject_the_greedy_answer_where_it_is_wrong(lm):
    """rejected="greedy": the rejected reply is the model's greedy completion, only where the
    verifier finds it wrong; the chosen one a right sample, else the reference answer."""
    from lmforge.align.reward import reference_reply
    from lmforge.align.rollout import RolloutEngine

    tok = lm.tokenizer
    records = D.load_prompts("task:add:1", n=12, seed=0)
    prompts = [D.prompt_ids(r, tok) for r in records]
    g = RolloutEngine(lm.model, tok, 3, 1.0).sample(prompts, records, 1, 0, False, greedy=True)
    greedy = [tuple(g.input_ids[i][g.attention_mask[i] == 1].tolist()) for i in range(len(g))]
    greedy_right = [odd_first({}, c) == 1.0 for c in g.completions]
    assert not all(greedy_right), "the test needs a prompt whose greedy answer is wrong"
    pairs, unpaired = policy_pairs(lm.model, tok, records, samples=16, pairs_per_prompt=2,
                                   max_new_tokens=3, judge=odd_first,
                                   rejected="greedy")  # fmt: skip
    rejected_by_prompt = {tuple(e.rejected.input_ids) for e in pairs.examples}
    assert rejected_by_prompt <= {ids for ids, ok in zip(greedy, greedy_right) if not ok}
    assert len(rejected_by_prompt) == len(records) - unpaired
    assert unpaired >= sum(greedy_right)
    answer_of = {tuple(p): r["answer"] for p, r in zip(prompts, records)}
    for e in pairs.examples:  # a right sample, or the prompt's reference answer
        n = e.chosen.prompt_len
        right = tok.decode(e.chosen.input_ids[n:], skip_special_tokens=True)
        reference = reference_reply(tok, answer_of[tuple(e.chosen.input_ids[:n])])
        assert odd_first({}, right) == 1.0 or tuple(e.chosen.input_ids[n:]) == reference
    # a verifier the random model never satisfies: every chosen reply is the reference answer,
    # and every prompt gives a pair (its greedy answer is wrong)
    exact = lambda record, completion: float(completion.strip() == record["answer"])  # noqa: E731
    pairs, unpaired = policy_pairs(lm.model, tok, records, samples=4, max_new_tokens=3,
                                   judge=exact, rejected="greedy")  # fmt: skip
    assert unpaired == 0 and len(pairs.examples) == len(records)
    for e, r, ids in zip(pairs.examples, records, greedy):
        n = e.chosen.prompt_len
        assert tuple(e.chosen.input_ids[n:]) == reference_reply(tok, r["answer"])
        assert tuple(e.rejected.input_ids) == ids
    with pytest.raises(DataError, match="no on-policy pairs"):  # greedy always right: none
        policy_pairs(lm.model, tok, records[:2], samples=4, judge=lambda r, c: 1.0,
                     rejected="greedy")  # fmt: skip
    with pytest.raises(ConfigError, match="rejected"):
        policy_pairs(lm.model, tok, records[:2], samples=4, rejected="best")


def test_reward_trainer_on_policy_pairs(lm, tmp_path, monkeypatch):
    import lmforge.align.reward as reward_module

    monkeypatch.setattr(reward_module, "verify", odd_first)
    lm.save(tmp_path / "policy")  # pairs sampled by another checkpoint than the RM's init
    cfg = RewardConfig(out_dir=str(tmp_path / "rm"), model=TINY, max_len=24, n_train=24,
                       n_eval=8, batch_size=8, max_iters=2, eval_interval=2, progress=False,
                       threads=1, pairs_from="policy", pair_samples=8, pair_max_new_tokens=3,
                       pair_policy=str(tmp_path / "policy"), pooling="match")  # fmt: skip
    t = RewardTrainer(cfg, log=lambda *a: None)
    assert t.train_examples and t.eval_examples
    for e in t.train_examples + t.eval_examples:  # labelled by the (patched) verifier
        n = e.chosen.prompt_len
        right, wrong = (lm.tokenizer.decode(x.input_ids[n:], skip_special_tokens=True)
                        for x in (e.chosen, e.rejected))  # fmt: skip
        assert odd_first({}, right) == 1.0 and odd_first({}, wrong) == 0.0
    r = t.run()
    assert math.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1
    with pytest.raises(ConfigError, match="pairs_from"):
        RewardConfig(pairs_from="labellers")
    with pytest.raises(ConfigError, match="pair_samples"):
        RewardConfig(pair_samples=1)
