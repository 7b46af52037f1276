"""Engine: same tokens as the plain reference loop (tests/infer/reference_generate.py) on every
path, continuous batching = running alone, prefix reuse = none, prompt embeddings = spliced ones."""

import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.infer import engine as engine_module
from lmforge.infer.engine import Engine, GenerationParams
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17], [3]]


@pytest.fixture(scope="module", params=["llama-micro", "gpt2-micro"])
def lm(request):
    torch.manual_seed(0)
    config = ModelConfig.from_preset(request.param, vocab_size=97, max_seq_len=64)
    return LM.from_config(config, seed=0)


def greedy(n):
    return GenerationParams(max_new_tokens=n, temperature=0.0)


def run_all(engine, requests, join_at=()):
    """Add (prompt, params) requests, the i-th after join_at[i] steps; collect tokens per id."""
    pending = list(enumerate(requests))
    rids, out, steps = {}, {}, 0
    while pending or engine.has_work():
        while pending and steps >= (join_at[pending[0][0]] if join_at else 0):
            i, (prompt, params) = pending.pop(0)
            rids[i] = engine.add_request(prompt, params)
            out[rids[i]] = []
        for o in engine.step():
            out[o.request_id] += o.token_ids
        steps += 1
    return [out[rids[i]] for i in range(len(requests))]


# a CPU prefill takes the prompts in groups of at most PREFILL_GROUP_TOKENS tokens:
# all of them in one forward, or (1 token) one forward per prompt
GROUPS = pytest.mark.parametrize("group_tokens", [256, 1], ids=["one_forward", "per_prompt"])


@GROUPS
def test_mixed_length_batch_matches_the_reference(
    lm, reference_generate, monkeypatch, group_tokens
):
    monkeypatch.setattr(engine_module, "PREFILL_GROUP_TOKENS", group_tokens)
    ref = reference_generate.generate(lm.model, PROMPTS, greedy(12))
    engine = Engine(lm.model, max_batch=4, eos_ids=[])
    assert [c.token_ids for c in engine.generate(PROMPTS, greedy(12))] == ref
    assert lm.generate(PROMPTS, max_new_tokens=12, temperature=0.0, eos_ids=[]) == ref


@pytest.mark.parametrize(
    "overrides",
    [
        dict(sliding_window=4),
        dict(attention_pattern={"type": "block_local", "block_size": 4}),
        dict(attention="linear"),
        dict(attention="mla", kv_lora_rank=16, qk_rope_head_dim=8),
    ],
    ids=["window", "block_local", "linear", "mla"],
)
def test_other_attention_kinds_take_the_per_kind_path(overrides, reference_generate):
    """Same tokens as the reference, uncached; more requests than slots: cohorts in turn,
    finished rows leaving the cache while the others go on."""
    config = ModelConfig.from_preset("llama-micro", vocab_size=97, max_seq_len=64, **overrides)
    model = LM.from_config(config, seed=0).model
    lens = (3, 15, 7, 12)
    ref = [reference_generate.generate(model, [p], greedy(m), use_cache=False)[0]
           for p, m in zip(PROMPTS, lens)]  # fmt: skip
    engine = Engine(model, max_batch=3, eos_ids=[])
    assert not engine.slots
    got = run_all(engine, [(p, greedy(m)) for p, m in zip(PROMPTS, lens)], join_at=(0, 0, 0, 2))
    assert got == ref and engine.cache is None


def test_continuous_batching_matches_running_alone(lm):
    lens = (3, 15, 7, 12)
    requests = [(p, greedy(m)) for p, m in zip(PROMPTS, lens)]
    # Two slots, late joiners, and a context of 24 columns: rows leave, slots are reused, the
    # running rows shift right (long prompt joins) and left (buffer full) along the way.
    engine = Engine(lm.model, max_batch=2, max_len=24, eos_ids=[])
    batched = run_all(engine, requests, join_at=(0, 0, 2, 9))
    alone = [
        Engine(lm.model, max_batch=1, max_len=24, eos_ids=[]).generate([p], g)[0].token_ids
        for p, g in requests
    ]
    assert batched == alone
    assert [len(t) for t in batched] == [3, 15, 7, 12]
    assert not engine.rows and engine.cache.n == 0


def test_context_limit_finishes_with_length(lm):
    engine = Engine(lm.model, max_batch=1, max_len=12, eos_ids=[])
    (c,) = engine.generate([PROMPTS[2]], greedy(50))
    assert len(c.token_ids) == 12 - len(PROMPTS[2]) and c.finish_reason == "length"


def test_prefix_reuse_equals_separate_prefills(lm):
    params = GenerationParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=5)
    shared = Engine(lm.model, max_batch=4, eos_ids=[])
    prefill_rows = []
    forward = shared.model  # prefills call the engine's model; decode steps their own handle
    shared.model = lambda ids, **kw: prefill_rows.append(ids.shape[0]) or forward(ids, **kw)
    reused = [c.token_ids for c in shared.generate([PROMPTS[0]], params, n=3)]
    assert prefill_rows == [1]  # three samples, one prefill of the prompt
    # One sample at a time (max_batch=1): no reuse; each still draws its own seeded stream.
    separate = Engine(lm.model, max_batch=1, eos_ids=[])
    assert [c.token_ids for c in separate.generate([PROMPTS[0]], params, n=3)] == reused
    assert len({tuple(t) for t in reused}) > 1  # the samples differ
    # prompt j of one call is seeded seed + j: a repeated prompt gets other samples
    twice = [c.token_ids for c in shared.generate([PROMPTS[0]] * 2, params, n=3)]
    assert twice[:3] == reused and twice[3:] != reused


@GROUPS
def test_prompt_embeddings_replace_the_token_embeddings(
    lm, reference_generate, monkeypatch, group_tokens
):
    """A request's prompt_embeds act exactly like the model seeing those input embeddings:
    compared with the reference loop whose embedding table returns them at prefill."""
    monkeypatch.setattr(engine_module, "PREFILL_GROUP_TOKENS", group_tokens)
    prompt = PROMPTS[2]
    embeds = torch.randn(len(prompt), lm.config.d_model)

    def splice(module, inputs, out):
        return embeds[None].to(out.dtype) if out.shape[1] == len(prompt) else out

    handle = lm.model.embed.register_forward_hook(splice)
    try:
        ref = reference_generate.generate(lm.model, [prompt], greedy(8))[0]
    finally:
        handle.remove()
    engine = Engine(lm.model, max_batch=3, eos_ids=[])
    got = engine.generate(
        [PROMPTS[0], prompt, prompt], greedy(8), prompt_embeds=[None, embeds, None]
    )
    plain = engine.generate([prompt], greedy(8))[0].token_ids
    assert got[1].token_ids == ref and ref != plain
    assert got[2].token_ids == plain  # same ids without embeddings: not shared with row 1
    with pytest.raises(ConfigError, match="prompt_embeds"):
        engine.add_request(prompt, greedy(2), prompt_embeds=embeds[:-1])


def test_seeded_sampling_is_independent_of_batch(lm):
    params = GenerationParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=123)
    alone = Engine(lm.model, max_batch=1, eos_ids=[]).generate([PROMPTS[1]], params)[0].token_ids
    engine = Engine(lm.model, max_batch=4, eos_ids=[])
    others = [(p, GenerationParams(max_new_tokens=8, temperature=1.0)) for p in PROMPTS[2:]]
    batched = run_all(engine, [*others, (PROMPTS[1], params)], join_at=(0, 0, 3))
    assert batched[-1] == alone


def test_eos_and_abort(lm):
    engine = Engine(lm.model, max_batch=2, eos_ids=[])
    first = engine.generate([PROMPTS[0]], greedy(5))[0].token_ids
    engine = Engine(lm.model, max_batch=2, eos_ids=[first[2]])
    (c,) = engine.generate([PROMPTS[0]], greedy(5))
    assert c.token_ids == first[: first.index(first[2]) + 1] and c.finish_reason == "stop"
    rid = engine.add_request(PROMPTS[1], greedy(40))
    engine.step()
    engine.abort(rid)
    outs = engine.step()
    assert [o.finish_reason for o in outs] == ["abort"] and not engine.has_work()


def test_logprobs_match_a_full_forward(lm):
    engine = Engine(lm.model, max_batch=2, eos_ids=[])
    params = GenerationParams(max_new_tokens=6, temperature=0.0, logprobs=3)
    (c,) = engine.generate([PROMPTS[0]], params)
    ids = torch.tensor([PROMPTS[0] + c.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(ids)[0].float(), -1)
    for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        expect = logp[len(PROMPTS[0]) - 1 + i]
        assert lp.token == tok and lp.logprob == pytest.approx(expect[tok].item(), abs=1e-4)
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy picks the most likely
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_text_streaming_and_stop_strings():
    text = "the quick brown fox jumps over the lazy dog " * 4
    tok = Tokenizer.train_char([text])
    config = ModelConfig.from_preset("llama-micro", vocab_size=tok.vocab_size, max_seq_len=64)
    lm = LM.from_config(config, tokenizer=tok, seed=1)
    engine = Engine.from_lm(lm, max_batch=2)
    params = GenerationParams(max_new_tokens=30, temperature=0.0, stop_token_ids=[])
    pieces = [o.text for o in engine.stream("the quick", params)]
    full = "".join(pieces)
    assert full == tok.decode(engine.generate(["the quick"], params)[0].token_ids, True)
    stop = full[5:7]
    params.stop = [stop]
    (c,) = engine.generate(["the quick"], params)
    assert c.text == full[: full.index(stop)] and c.finish_reason == "stop"


def test_bad_requests_are_config_errors(lm):
    engine = Engine(lm.model, max_batch=2, eos_ids=[], max_len=16)
    with pytest.raises(ConfigError, match="context"):
        engine.add_request(list(range(16)), greedy(1))
    with pytest.raises(ConfigError, match="empty"):
        engine.add_request([], greedy(1))
    with pytest.raises(ConfigError, match="token ids"):
        engine.add_request([500], greedy(1))
    with pytest.raises(ConfigError, match="temperature"):
        GenerationParams(temperature=-1)
    with pytest.raises(ConfigError, match="logprobs"):
        GenerationParams(logprobs=21)
    with pytest.raises(ConfigError, match="max_seq_len=64"):
        Engine(lm.model, eos_ids=[]).add_request(list(range(64)), greedy(1))


def test_generation_runs_in_eval_mode_and_restores_training(make_tiny_lm):
    """A model being trained (dropout active) is switched to eval mode for a generation and handed
    back in training mode (an RL policy goes on training)."""
    import dataclasses

    from lmforge.lm import LM

    lm = make_tiny_lm(64)
    lm = LM(type(lm.model)(dataclasses.replace(lm.model.config, dropout=0.5)), lm.tokenizer)
    lm.model.train()
    seen = []
    for block in lm.model.modules():
        block.register_forward_hook(lambda m, args, out: seen.append(m.training))
    prompt = [lm.tokenizer.encode("The answer is")]
    first = lm.generate(prompt, max_new_tokens=12, temperature=0.0)
    assert seen and not any(seen)  # no module ran in training mode
    assert first == lm.generate(prompt, max_new_tokens=12, temperature=0.0)
    assert lm.model.training and all(m.training for m in lm.model.modules())
