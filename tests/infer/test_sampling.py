import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.infer.sampling import (
    SamplingParams,
    sample_next,
    softmax_with_temperature,
    top_k_filter,
    top_p_filter,
)


def test_worked_temperature_example():
    z = torch.tensor([2.0, 1.0, 0.1])
    expected = {
        1.0: [0.6590, 0.2424, 0.0986],
        0.5: [0.8638, 0.1169, 0.0193],
        2.0: [0.5017, 0.3043, 0.1940],
    }
    for tau, probs in expected.items():
        assert torch.allclose(softmax_with_temperature(z, tau), torch.tensor(probs), atol=1e-4)
    words = ["cat", "dog", "car"]
    assert words[int(sample_next(z[None], temperature=0.0))] == "cat"


def test_top_p_spec_example_keeps_three():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(top_p_filter(logits, 0.9))
    assert kept.tolist() == [[True, True, True, False]]
    assert torch.isfinite(top_p_filter(logits, 0.5)).sum() == 1


def test_top_k_keeps_ties():
    out = top_k_filter(torch.tensor([[1.0, 3.0, 2.0, 2.0]]), 2)
    assert torch.isfinite(out).tolist() == [[False, True, True, True]]


def test_sampling_respects_filters_and_seed():
    logits = torch.tensor([[5.0, 4.0, -1.0, -2.0]]).repeat(500, 1)
    g = torch.Generator().manual_seed(0)
    tokens = sample_next(logits, 1.0, top_k=2, generator=g)
    assert set(tokens.tolist()) <= {0, 1} and len(set(tokens.tolist())) == 2
    a = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(3))
    b = sample_next(logits, 1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**kwargs)
