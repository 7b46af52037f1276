import pytest
import torch

from lmforge.model.cross_attention import CrossAttention


def test_latent_block_output_is_b_m_d_for_any_length(spec_exhibits):
    torch.manual_seed(0)
    block = spec_exhibits.LatentBlock(d_model=32, n_head=4, n_latents=6, d_input=24)
    for length in (1, 7, 50):
        assert block(torch.randn(3, length, 24)).shape == (3, 6, 32)


def test_latent_block_ignores_masked_input_positions(spec_exhibits):
    torch.manual_seed(0)
    block = spec_exhibits.LatentBlock(d_model=16, n_head=2, n_latents=4)
    x = torch.randn(1, 5, 16)
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    changed = x.clone()
    changed[:, 3:] = torch.randn(1, 2, 16)
    assert torch.allclose(block(x, mask), block(changed, mask), atol=1e-6)
    assert torch.allclose(block(x, mask), block(x[:, :3]), atol=1e-6)


def test_cross_attention_uses_queries_from_x_and_keys_values_from_memory():
    torch.manual_seed(0)
    attn = CrossAttention(16, 4, d_memory=8)
    x, memory = torch.randn(2, 3, 16), torch.randn(2, 9, 8)
    out = attn(x, memory)
    assert out.shape == (2, 3, 16)
    assert torch.allclose(attn(x, kv=attn.memory_kv(memory)), out)
    # a query's output does not depend on the other queries
    assert torch.allclose(attn(x[:, :1], memory), out[:, :1], atol=1e-6)


def test_permutation_equivariance_without_positions():
    """Attention(PX) = P·Attention(X) (permutation equivariance)."""
    torch.manual_seed(0)
    attn = CrossAttention(32, 4)
    x = torch.randn(1, 7, 32)
    perm = torch.randperm(7)
    assert torch.allclose(attn(x[:, perm]), attn(x)[:, perm], atol=1e-6)


def test_the_dog_chased_another_dog_both_dogs_are_equal():
    torch.manual_seed(0)
    words = "the dog chased another dog".split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    embed = torch.nn.Embedding(len(vocab), 32)
    attn = CrossAttention(32, 4)
    out = attn(embed(torch.tensor([[vocab[w] for w in words]])))[0]
    assert torch.allclose(out[1], out[4], atol=1e-6)
    assert not torch.allclose(out[1], out[2], atol=1e-3)


def test_cross_attention_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="n_head"):
        CrossAttention(30, 4)
