import pytest
import torch

from lmforge.model.cache import new_cache
from lmforge.model.config import ModelConfig
from lmforge.model.linear_attention import (
    EPS,
    FEATURE_MAP_NAMES,
    build_feature_map,
    causal_linear_attention,
    linear_attention,
)
from lmforge.model.transformer import Transformer


def quadratic_linear_attention(fq, fk, v, causal: bool = True, eps: float = EPS) -> torch.Tensor:
    """The explicit normalised quadratic form (A V) / (A 1 + ε), A = φ(Q)φ(K)ᵀ (masked if
    causal). O(T²): for tests and teaching."""
    a = fq @ fk.transpose(-2, -1)
    if causal:
        a = a.tril()
    return (a @ v.float()) / (a.sum(-1, keepdim=True) + eps)


def features(name, shape=(2, 3, 11, 8), seed=0):
    torch.manual_seed(seed)
    phi = build_feature_map(name, shape[-1])
    q, k, v = (torch.randn(shape) for _ in range(3))
    return phi(q), phi(k), v


@pytest.mark.parametrize("name", FEATURE_MAP_NAMES)
def test_feature_maps_are_non_negative(name):
    fq, fk, _ = features(name)
    assert (fq >= 0).all() and (fk >= 0).all()


@pytest.mark.parametrize("name", FEATURE_MAP_NAMES)
def test_linear_form_equals_explicit_normalised_quadratic_form(name):
    fq, fk, v = features(name)
    expected = quadratic_linear_attention(fq, fk, v, causal=False)
    assert torch.allclose(linear_attention(fq, fk, v), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", FEATURE_MAP_NAMES)
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_causal_running_sums_equal_masked_quadratic_form(name, chunk):
    fq, fk, v = features(name)
    out, _ = causal_linear_attention(fq, fk, v, chunk=chunk)
    expected = quadratic_linear_attention(fq, fk, v, causal=True)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-4)


def test_recurrent_state_continues_the_sequence():
    fq, fk, v = features("elu")
    full, (s, z) = causal_linear_attention(fq, fk, v)
    head, state = causal_linear_attention(fq[:, :, :6], fk[:, :, :6], v[:, :, :6])
    tail, (s2, z2) = causal_linear_attention(fq[:, :, 6:], fk[:, :, 6:], v[:, :, 6:], state)
    assert torch.allclose(torch.cat([head, tail], 2), full, atol=1e-6)
    assert torch.allclose(s2, s, atol=1e-5) and torch.allclose(z2, z, atol=1e-5)


def test_attention_weights_match_the_kernel_definition():
    """attn_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j), checked by hand for one query."""
    fq, fk, v = features("relu2", shape=(1, 1, 5, 4))
    w = (fk @ fq[0, 0, 4]).squeeze(0).squeeze(0)
    by_hand = (w[:, None] * v[0, 0]).sum(0) / (w.sum() + 1e-6)
    assert torch.allclose(linear_attention(fq, fk, v)[0, 0, 4], by_hand, atol=1e-5)


def test_state_cache_is_constant_size_and_decodes_like_the_full_pass():
    config = ModelConfig(vocab_size=30, n_layer=2, d_model=32, n_head=4, attention="linear")
    model = Transformer(config).eval()
    ids = torch.randint(0, 30, (1, 20))
    cache = new_cache(config, 1, 20)
    size = cache.nbytes()
    steps = [model(ids[:, :1], cache=cache)] + [
        model(ids[:, t : t + 1], cache=cache) for t in range(1, 20)
    ]
    assert cache.nbytes() == size
    assert torch.allclose(torch.cat(steps, 1), model(ids), atol=1e-5)


def test_random_features_are_saved_with_the_model():
    config = ModelConfig(vocab_size=30, n_layer=1, d_model=32, n_head=4, attention="linear",
                         linear_feature_map="rff")  # fmt: skip
    state = Transformer(config).state_dict()
    assert "blocks.0.attn.feature_map.proj" in state
