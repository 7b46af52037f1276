import torch

from lmforge.model.cache import LatentKVCache, new_cache
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer

MLA = dict(vocab_size=50, n_layer=2, d_model=64, n_head=4, attention="mla", pos="rope",
           kv_lora_rank=16, qk_rope_head_dim=8)  # fmt: skip


def test_cache_stores_latent_plus_rope_key_per_token():
    config = ModelConfig(**MLA)
    cache = new_cache(config, batch_size=1, max_len=100)
    assert isinstance(cache, LatentKVCache)
    per_token_layer = cache.nbytes() / (100 * config.n_layer * 4)
    assert per_token_layer == 16 + 8  # vs MHA: 2 * n_head * head_dim = 128
    mha = new_cache(ModelConfig(**{**MLA, "attention": "softmax"}), 1, 100)
    assert mha.nbytes() / cache.nbytes() == 128 / 24


def test_rope_rotates_only_the_decoupled_part():
    model = Transformer(ModelConfig(**MLA))
    assert model.rope.cos.shape[-1] == 8


def test_rope_key_is_relative_position_aware():
    """Shifting every position by c leaves the logits unchanged (RoPE only in the rope part)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MLA)).eval()
    ids = torch.randint(0, 50, (1, 9))
    shifted = model(ids, positions=torch.arange(9) + 5)
    assert torch.allclose(model(ids), shifted, atol=1e-5)


def test_heads_share_one_latent_but_differ():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MLA)).eval()
    attn = model.blocks[0].attn
    assert attn.kv_down.out_features == 16 + 8
    assert attn.kv_up.out_features == 4 * 2 * 16
