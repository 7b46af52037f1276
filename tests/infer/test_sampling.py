"""The one sampler (lmforge.infer.sampling): the top-k / top-p rule against transformers' logits
warpers, worked examples, and per-row randomness that makes seeds reproducible."""

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from lmforge.errors import ConfigError
from lmforge.infer.params import GenerationParams
from lmforge.infer.sampling import (
    RowSampler,
    draw,
    filter_top_k_top_p,
    request_uniforms,
    sampling_probs,
)


def test_worked_temperature_example():
    z = torch.tensor([[2.0, 1.0, 0.1]])
    expected = {
        1.0: [0.6590, 0.2424, 0.0986],
        0.5: [0.8638, 0.1169, 0.0193],
        2.0: [0.5017, 0.3043, 0.1940],
    }
    for tau, probs in expected.items():
        got = sampling_probs(z, GenerationParams(temperature=tau))[0]
        assert torch.allclose(got, torch.tensor(probs), atol=1e-4)


def test_top_p_spec_example_keeps_three():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    full_k = torch.tensor([4])
    kept = torch.isfinite(filter_top_k_top_p(logits, full_k, torch.tensor([0.9])))
    assert kept.tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_top_k_top_p(logits, full_k, torch.tensor([0.5]))).sum() == 1


def test_top_k_keeps_ties():
    out = filter_top_k_top_p(torch.tensor([[1.0, 3.0, 2.0, 2.0]]), torch.tensor([2]), torch.ones(1))
    assert torch.isfinite(out).tolist() == [[False, True, True, True]]


@pytest.mark.parametrize("k,p", [(5, 1.0), (50, 0.9), (3, 0.5), (64, 0.3), (1, 0.99)])
def test_filter_equals_transformers_warpers(k, p):
    """Same kept set as TopKLogitsWarper then TopPLogitsWarper (transformers' own order)."""
    torch.manual_seed(k)
    logits = torch.randn(6, 64) * 3
    ours = filter_top_k_top_p(logits, torch.full((6,), k), torch.full((6,), p))
    theirs = TopKLogitsWarper(k)(None, logits.clone())
    if p < 1:
        theirs = TopPLogitsWarper(p)(None, theirs)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))


def test_rows_keep_their_own_settings():
    logits = torch.tensor([[5.0, 4.0, -1.0, -2.0]]).repeat(3, 1)
    per_row = filter_top_k_top_p(logits, torch.tensor([1, 2, 4]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.isfinite(per_row).sum(-1).tolist() == [1, 2, 1]


def test_draw_follows_the_distribution_and_uniforms():
    probs = torch.tensor([[0.1, 0.2, 0.7]])
    u = torch.tensor([0.05, 0.15, 0.29, 0.31, 0.99])
    assert draw(probs.expand(5, 3), u).tolist() == [0, 1, 1, 2, 2]


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    params = GenerationParams(temperature=1.0, top_k=3)
    logits = torch.randn(1, 16)
    alone = RowSampler(1, 16, 8)
    alone.start_row(0, params, [1], request_uniforms(1, 8, seed=4)[0])
    mine = [alone.sample(logits)[1][0] for _ in range(8)]
    batch = RowSampler(3, 16, 8)
    batch.start_row(0, GenerationParams(temperature=0.0), [1], None)
    batch.start_row(1, GenerationParams(temperature=2.0), [2], request_uniforms(1, 8, None)[0])
    batch.start_row(2, params, [1], request_uniforms(1, 8, seed=4)[0])
    together = [batch.sample(torch.cat([torch.randn(2, 16), logits]))[1][2] for _ in range(8)]
    assert together == mine
    assert len(set(mine)) > 1  # it did sample
    other = RowSampler(1, 16, 8)
    other.start_row(0, params, [1], request_uniforms(1, 8, seed=5)[0])
    assert [other.sample(logits)[1][0] for _ in range(8)] != mine


def test_suppressed_tokens_are_never_picked():
    sampler = RowSampler(2, 4, 4)
    sampler.start_row(0, GenerationParams(temperature=0.0, suppress_token_ids=[3]), [1], None)
    sampler.start_row(1, GenerationParams(temperature=0.0), [1], None)
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0], [0.0, 1.0, 2.0, 9.0]])
    assert sampler.sample(logits)[1] == [2, 3]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        GenerationParams(**kwargs)


def test_two_level_draw_equals_the_one_level_inverse_cdf():
    probs = torch.softmax(torch.randn(200, 1000) * 3, -1)
    probs[:, 500:700] = 0  # filtered tokens (a whole block and parts of others)
    u = torch.rand(200, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    got = draw(probs, u)
    assert torch.equal(got, want) and not ((got >= 500) & (got < 700)).any()
