"""Speculative decoding on the engine: greedy output equals the target's own, sampling follows
the target's distribution exactly (chi-square against the exact joint of the first two tokens),
EOS, stop strings and budgets are respected, rewound caches equal a fresh prefill, and the LM /
CLI entry points."""

import copy
import math

import pytest
import torch
from scipy.stats import chi2

from lmforge.cli.main import main
from lmforge.errors import ConfigError
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.infer.sampling import sampling_probs
from lmforge.infer.speculative import SpeculativeDecoder, SpeculativeStats, rewind
from lmforge.lm import LM
from lmforge.model.cache import new_cache
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer

PROMPTS = [[5], [1, 2, 3], list(range(3, 23))]


def speculative(target, draft, prompts, params, k=4, eos=()):
    """(token ids per prompt, the engine's counters) from an engine with a draft model."""
    engine = Engine(target, max_batch=2, eos_ids=list(eos), draft=draft, draft_tokens=k)
    return [c.token_ids for c in engine.generate(prompts, params)], engine.speculative_stats


def plain(target, prompts, params):
    return [c.token_ids for c in Engine(target, max_batch=4, eos_ids=[]).generate(prompts, params)]


def rounds(spec, prompt, params, generator=None, stats=None):
    return [t for chunk in spec.stream(prompt, params, (), None, generator, stats) for t in chunk]


def llama(seed: int, vocab: int = 61, **overrides) -> torch.nn.Module:
    config = ModelConfig.from_preset("llama-micro", vocab_size=vocab, max_seq_len=80, **overrides)
    return LM.from_config(config, seed=seed).model.eval()


@pytest.fixture(scope="module")
def target():
    return llama(0)


@pytest.fixture(scope="module")
def drafts(target):
    """A model that disagrees with the target almost always, one that disagrees sometimes
    (the target's weights plus noise, a smaller width would not share them), and the target."""
    noisy = copy.deepcopy(target)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.003)
    return {"other": llama(1, n_layer=1), "noisy": noisy, "same": target}


@pytest.mark.parametrize("kind", ["other", "noisy", "same"])
def test_greedy_equals_target_greedy(target, drafts, kind, reference_generate):
    params = GenerationParams(30, temperature=0.0)
    total = SpeculativeStats()
    expected = [reference_generate.generate(target, [p], params)[0] for p in PROMPTS]
    for k in (1, 3, 5):
        got, stats = speculative(target, drafts[kind], PROMPTS, params, k)
        assert got == expected, k
        assert stats.new_tokens == 30 * len(PROMPTS) and 0 <= stats.accepted <= stats.proposed
        if kind == "same":
            assert stats.acceptance_rate == 1.0
            assert stats.target_calls == len(PROMPTS) * math.ceil(30 / (k + 1))
        total.proposed += stats.proposed
        total.accepted += stats.accepted
    rate = total.acceptance_rate
    assert {"other": rate < 0.2, "noisy": 0.2 < rate < 0.9, "same": rate == 1.0}[kind], rate


def tiny(seed: int) -> torch.nn.Module:
    """8-token vocabulary; init_std 0.3 makes the distributions peaked and unlike each other."""
    config = ModelConfig(vocab_size=8, n_layer=1, n_head=2, d_model=16, max_seq_len=16,
                         init_std=0.3)  # fmt: skip
    return LM.from_config(config, seed=seed).model.eval()


@pytest.mark.parametrize("sampling", [(1.0, None, None), (0.8, 5, 0.9)])
@torch.inference_mode()
def test_sampling_follows_the_target_exactly(sampling):
    """The first two tokens (K=2: accepted drafts, residual draws and bonus tokens all occur)
    against their exact joint distribution under the target. Always accepting the drafts
    gives chi2 ~ 15000 here, drawing rejections from p instead of max(0, p - q) ~ 400;
    the bound is the 1 - 1e-4 quantile (~90)."""
    target, draft = tiny(0), tiny(1)
    prompt, n = [1, 2, 3], 2000
    params = GenerationParams(3, *sampling)
    first = sampling_probs(target(torch.tensor([prompt]))[0, -1:], params)[0]
    second = torch.stack([
        sampling_probs(target(torch.tensor([prompt + [a]]))[0, -1:], params)[0] for a in range(8)
    ])  # fmt: skip
    joint = (first[:, None] * second).flatten().double()
    spec = SpeculativeDecoder(target, draft, draft_tokens=2)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(64, dtype=torch.float64)
    accepted = 0
    stats = SpeculativeStats()
    for _ in range(n):
        tokens = rounds(spec, prompt, params, generator, stats)
        counts[tokens[0] * 8 + tokens[1]] += 1
    accepted = stats.accepted
    assert 0.2 < accepted / n < 1.8  # both outcomes of the acceptance test happen often
    assert counts[joint == 0].sum() == 0  # top-k / top-p exclusions are never produced
    expected = joint * n
    big, small = expected >= 5, (expected > 0) & (expected < 5)  # pool the rare cells
    stat = ((counts - expected) ** 2 / expected)[big].sum()
    if small.any():
        stat += (counts[small].sum() - expected[small].sum()) ** 2 / expected[small].sum()
    df = int(big.sum()) + int(small.any()) - 1
    assert stat < chi2.ppf(1 - 1e-4, df), (float(stat), df)


def test_seed_is_deterministic(target, drafts):
    params = GenerationParams(20, temperature=1.0, top_p=0.95, seed=3)
    first, _ = speculative(target, drafts["noisy"], [[1, 2, 3]], params, 3)
    assert speculative(target, drafts["noisy"], [[1, 2, 3]], params, 3)[0] == first
    other = GenerationParams(20, temperature=1.0, top_p=0.95, seed=4)
    assert speculative(target, drafts["noisy"], [[1, 2, 3]], other, 3)[0] != first


def test_eos_and_budget(target, drafts):
    greedy = GenerationParams(30, temperature=0.0)
    (ref,) = plain(target, [[1, 2, 3]], greedy)
    eos = ref[7]
    got, _ = speculative(target, drafts["same"], [[1, 2, 3]], greedy, eos=[eos])
    assert got[0] == ref[: ref.index(eos) + 1]
    for n in (1, 2, 5, 9):  # every budget is met exactly, whatever K
        params = GenerationParams(n, temperature=1.0)
        assert len(speculative(target, drafts["same"], [[1, 2, 3]], params)[0][0]) == n
    long_prompt = [i % 61 for i in range(75)]  # max_seq_len 80: 5 new at most
    got, _ = speculative(target, drafts["same"], [long_prompt], greedy)
    assert got == plain(target, [long_prompt], greedy) and len(got[0]) == 5


def test_vocab_mismatch_and_bad_settings(target):
    with pytest.raises(ConfigError, match="vocab_size=61.*vocab_size=64"):
        Engine(target, draft=llama(1, vocab=64))
    with pytest.raises(ConfigError, match="draft_tokens"):
        Engine(target, draft=target, draft_tokens=0)
    windowed = llama(0, sliding_window=8)
    with pytest.raises(ConfigError, match="rewind"):
        Engine(windowed, draft=windowed)
    with pytest.raises(ConfigError, match="penalties"):
        Engine(target, draft=target).add_request([1], GenerationParams(repetition_penalty=1.2))


@torch.inference_mode()
def test_rewind_equals_fresh_prefill(target):
    seq, rejected = [4, 8, 15, 16, 23], [42, 7, 9]
    cache = new_cache(target.config, 1, 20)
    target(torch.tensor([seq + rejected]), cache=cache)
    rewind(cache, len(seq))
    after = target(torch.tensor([[33]]), cache=cache)[0, -1]
    fresh = target(torch.tensor([seq + [33]]))[0, -1]
    assert torch.allclose(after, fresh, atol=1e-5)


@torch.inference_mode()
def test_caches_after_sampling_equal_fresh_prefill(target, drafts):
    """After a sampled run with many rejections, each model's cache plus its pending tokens
    gives the logits a fresh forward over prompt + output gives."""
    prompt = [1, 2, 3]
    spec = SpeculativeDecoder(target, drafts["noisy"], 4)
    stats = SpeculativeStats()
    tokens = rounds(spec, prompt, GenerationParams(25, temperature=1.0), None, stats)
    assert stats.accepted < stats.proposed  # rejections happened
    sequence = torch.tensor([prompt + tokens])
    for side, model in ((spec.target_side, target), (spec.draft_side, drafts["noisy"])):
        assert side.committed == sequence.shape[1]
        nxt = side.feed([], last_only=True)[-1]
        assert torch.allclose(nxt, model(sequence)[0, -1], atol=1e-4)


TEXT = "to be or not to be that is the question "


@pytest.fixture(scope="module")
def lms():
    tok = Tokenizer.train_char([TEXT])
    config = ModelConfig.from_preset(
        "llama-micro", vocab_size=tok.vocab_size, max_seq_len=64, n_layer=2
    )
    target = LM.from_config(config, tokenizer=tok, seed=0)
    draft = LM.from_config(ModelConfig.from_dict({**config.to_dict(), "n_layer": 1}), tok, seed=1)
    return target, draft


def test_lm_generate_complete_stream(lms):
    target, draft = lms
    kw = dict(max_new_tokens=12, temperature=0.0)
    ids = target.generate([[3, 4], [5]], **kw, eos_ids=[])
    assert target.generate([[3, 4], [5]], **kw, eos_ids=[], draft=draft, draft_tokens=3) == ids
    assert target.speculative_stats.new_tokens == 24
    text = target.complete("to be", **kw)
    assert target.complete("to be", **kw, draft=draft) == text
    assert "".join(target.stream("to be", **kw, draft=draft, draft_tokens=2)) == text[0]
    stop = text[0][3:5]  # a stop string cuts inside a round of several tokens
    cut = target.complete("to be", **kw, stop=[stop], draft=draft, draft_tokens=4)
    assert cut == [text[0][: text[0].index(stop)]]


def test_cli_draft_prints_the_same_text(lms, tmp_path, capsys):
    target, draft = lms
    target.save(tmp_path / "target")
    draft.save(tmp_path / "draft")
    argv = ["generate", "--checkpoint", str(tmp_path / "target"), "--prompt", "to be",
            "--temperature", "0", "--max-new-tokens", "10"]  # fmt: skip
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--draft", str(tmp_path / "draft"), "--draft-tokens", "3"]) == 0
    out = capsys.readouterr()
    assert out.out == plain and "draft tokens accepted" in out.err
