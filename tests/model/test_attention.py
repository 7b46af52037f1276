import pytest
import torch

from lmforge.model.attention import (
    causal_mask,
    explicit_attention,
    sdpa_attention,
)
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_explicit_equals_sdpa(kv_heads):
    q = torch.randn(2, 4, 9, 16)
    k, v = torch.randn(2, kv_heads, 9, 16), torch.randn(2, kv_heads, 9, 16)
    for kwargs in (dict(is_causal=True), dict(mask=causal_mask(9, 9)), dict()):
        a = explicit_attention(q, k, v, **kwargs)
        b = sdpa_attention(q, k, v, **kwargs)
        assert torch.allclose(a, b, atol=1e-5)


def test_gqa_with_g_equal_h_is_mha_and_g_one_is_mqa():
    q = torch.randn(1, 4, 6, 8)
    k1, v1 = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    mqa = explicit_attention(q, k1, v1, is_causal=True)
    mha = explicit_attention(q, k1.expand(1, 4, 6, 8), v1.expand(1, 4, 6, 8), is_causal=True)
    assert torch.allclose(mqa, mha, atol=1e-6)
    k2, v2 = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    gqa = explicit_attention(q, k2, v2, is_causal=True)
    # head h uses KV group h // (H / G): heads 0,1 -> group 0; heads 2,3 -> group 1
    groups = explicit_attention(
        q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), is_causal=True
    )
    assert torch.allclose(gqa, groups, atol=1e-6)


def test_softmax_scale_is_sqrt_head_dim():
    q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 3, 64)
    v = torch.eye(3)[None, None]
    weights = explicit_attention(q, k, v)[0, 0, 0]
    expected = torch.softmax((q[0, 0] @ k[0, 0].T)[0] / 8.0, dim=-1)
    assert torch.allclose(weights, expected, atol=1e-6)


def test_permutation_equivariance_without_positions():
    """'the dog chased another dog': both 'dog' outputs are equal when nothing encodes order."""
    torch.manual_seed(0)
    vocab = {"the": 0, "dog": 1, "chased": 2, "another": 3}
    ids = torch.tensor([[vocab[w] for w in "the dog chased another dog".split()]])
    embed = torch.nn.Embedding(4, 16)
    wq, wk, wv = (torch.nn.Linear(16, 16, bias=False) for _ in range(3))
    x = embed(ids)

    def attend(x):
        q, k, v = (w(x).view(1, -1, 2, 8).transpose(1, 2) for w in (wq, wk, wv))
        return explicit_attention(q, k, v).transpose(1, 2).reshape(1, -1, 16)

    out = attend(x)
    assert torch.allclose(out[0, 1], out[0, 4], atol=1e-6)
    perm = torch.tensor([3, 0, 4, 1, 2])
    assert torch.allclose(attend(x[:, perm]), out[:, perm], atol=1e-6)


def test_causal_mask_rows():
    m = causal_mask(3, 3).int().tolist()
    assert m == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert causal_mask(2, 4).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_padded_mask_hides_padding_and_keeps_rows_finite():
    key_mask = torch.tensor([[False, True, True], [True, True, True]])
    m = causal_mask(3, 3, key_mask=key_mask)[:, 0].int()
    assert m[0].tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]  # pad row sees only itself
    assert m[1].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False),
        dict(pos="sinusoidal", n_kv_head=1, attn_impl="explicit"),
        dict(pos="none", mlp="geglu"),
    ],
)
def test_causality_gradient(kw):
    """d s_t / d e_tau = 0 for tau > t: no position sees the future."""
    model = Transformer(ModelConfig(vocab_size=32, n_layer=2, d_model=32, n_head=4, **kw))
    ids = torch.randint(0, 32, (1, 8))
    emb = model.embed(ids).detach().requires_grad_(True)
    model.embed.forward = lambda _ids: emb  # feed the leaf tensor through the model
    t = 4
    logits = model(ids)
    logits[0, t].sum().backward()
    grad = emb.grad[0].abs().sum(-1)
    assert (grad[t + 1 :] == 0).all()
    assert (grad[: t + 1] > 0).all()


def test_kv_cache_seed_example():
    """Seed 001 §6.2.1: cached keys/values are the projections of each new token."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    w_k = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    w_v = torch.tensor([[0.5, -0.5], [1.0, 0.5]])
    keys, values = [], []
    for token in x:  # project only the new token, append to the cache
        keys.append(token @ w_k)
        values.append(token @ w_v)
    assert torch.stack(keys).tolist() == [[1, 4], [3, 10], [5, 16]]
    assert torch.allclose(torch.stack(values), torch.tensor([[2.5, 0.5], [5.5, 0.5], [8.5, 0.5]]))
