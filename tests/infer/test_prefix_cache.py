"""Prefix caching across requests: the same tokens and log-probabilities as prefilling every
prompt in full (the plain engine), hits counted, and the pool kept within its byte budget."""

import pytest
import torch

from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.infer.prefix_cache import PrefixCache
from lmforge.lm import LM
from lmforge.model.config import ModelConfig

SYSTEM = list(range(3, 3 + 40))  # a 40-token "system prompt" shared by every request
QUESTIONS = [[50, 51, 52], [60, 61], [70, 71, 72, 73, 74], [50, 51, 52]]
MB256 = 256 * 2**20
GREEDY = GenerationParams(max_new_tokens=8, temperature=0, logprobs=2, stop_token_ids=[])


@pytest.fixture(scope="module")
def lm() -> LM:
    config = ModelConfig.from_preset("llama-micro", vocab_size=128, max_seq_len=256)
    return LM.from_config(config, seed=0)


def run_one(engine, prompt, params=GREEDY):
    (c,) = engine.generate([prompt], params)
    return c.token_ids, [lp.logprob for lp in c.logprobs]


def test_same_tokens_as_full_prefills_and_hits_counted(lm):
    plain = Engine.from_lm(lm, max_batch=4)
    cached = Engine.from_lm(lm, max_batch=4, prefix_block=8, prefix_cache_bytes=MB256)
    for q in QUESTIONS:
        want_tokens, want_lp = run_one(plain, SYSTEM + q)
        got_tokens, got_lp = run_one(cached, SYSTEM + q)
        assert got_tokens == want_tokens
        assert torch.allclose(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4)
    stats = cached.prefix_cache_stats
    # the first prompt fills the pool; the next three find the 40 shared tokens (5 blocks),
    # the repeated question its own 3 tokens' block too when they complete one
    assert stats.hit >= 3 * 40 and stats.queried == sum(len(SYSTEM + q) for q in QUESTIONS)


def test_joining_a_running_batch_with_a_cached_prefix(lm):
    plain = Engine.from_lm(lm, max_batch=4)
    want = {tuple(q): run_one(plain, SYSTEM + q)[0] for q in QUESTIONS[:3]}
    cached = Engine.from_lm(lm, max_batch=4, prefix_block=8, prefix_cache_bytes=MB256)
    run_one(cached, SYSTEM + [9, 9])  # fills the pool
    long = GenerationParams(max_new_tokens=8, temperature=0, stop_token_ids=[])
    outs: dict[str, list[int]] = {}
    rids = {}
    for q in QUESTIONS[:3]:  # each joins while the earlier ones decode
        rids[cached.add_request(SYSTEM + q, long)] = tuple(q)
        for out in cached.step():
            outs.setdefault(out.request_id, []).extend(out.token_ids)
    while cached.has_work():
        for out in cached.step():
            outs.setdefault(out.request_id, []).extend(out.token_ids)
    assert {rids[r]: tokens for r, tokens in outs.items()} == want
    assert cached.prefix_cache_stats.hit >= 3 * 40


def test_eviction_keeps_the_budget_and_the_results(lm):
    plain = Engine.from_lm(lm, max_batch=2)
    block_bytes = 2 * lm.config.n_layer * lm.config.n_kv_head * 8 * lm.config.head_dim * 4
    cached = Engine.from_lm(lm, max_batch=2, prefix_block=8,
                            prefix_cache_bytes=3 * block_bytes)  # fmt: skip
    for q in QUESTIONS * 2:
        assert run_one(cached, SYSTEM + q)[0] == run_one(plain, SYSTEM + q)[0]
        assert cached.prefix_cache.bytes <= 3 * block_bytes
    assert len(cached.prefix_cache.blocks) == 3


def test_lookup_stops_at_the_first_missing_block_and_leaves_one_token():
    pool = PrefixCache(block_size=2, max_bytes=10**6)
    kv = (torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1))
    pool.insert([1, 2, 3, 4, 5, 6], lambda i: kv)
    assert len(pool.lookup([1, 2, 3, 4, 9, 9, 9])) == 2
    assert len(pool.lookup([1, 2, 3, 4, 5, 6])) == 2  # the last token is always prefilled
    assert len(pool.lookup([2, 1, 3, 4])) == 0  # a block stands for its whole prefix
    assert pool.keys([1, 2, 3, 4])[1] != pool.keys([9, 9, 3, 4])[1]


def test_a_prompt_whose_reply_ends_at_once_is_still_cached(lm):
    cached = Engine.from_lm(lm, max_batch=1, prefix_block=8, prefix_cache_bytes=MB256)
    one = GenerationParams(max_new_tokens=1, temperature=0)
    cached.generate([SYSTEM + [1]], one)
    cached.generate([SYSTEM + [2]], one)
    assert cached.prefix_cache_stats.hit == 40
