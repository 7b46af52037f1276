"""FastDecoder computes what Transformer.forward computes (with and without a cache, padding,
last_only), on the configs it covers; the others are reported and the engine falls back."""

import pytest
import torch

from lmforge.infer.decoder import FastDecoder
from lmforge.infer.engine import Engine, GenerationParams
from lmforge.lm import LM
from lmforge.model.cache import KVCache
from lmforge.model.config import ModelConfig

COVERED = {
    "llama": dict(preset="llama-micro"),  # RMSNorm, RoPE, SwiGLU, GQA
    "gpt2": dict(preset="gpt2-micro"),  # LayerNorm with biases, learned positions, GELU
    "qwen3-ish": dict(
        preset="llama-micro",
        qk_norm=True,
        rope_interleaved=True,
        attention_bias=True,
        logit_scaling=True,
        pos="rope",
    ),  # fmt: skip
    "sinusoidal-relu": dict(preset="gpt2-micro", pos="sinusoidal", mlp="relu", bias=False),
}


def build(preset, **overrides):
    config = ModelConfig.from_preset(preset, vocab_size=61, max_seq_len=48, **overrides)
    return LM.from_config(config, seed=0).model.eval()


@pytest.mark.parametrize("name", COVERED)
@torch.inference_mode()
def test_matches_transformer_forward(name):
    model = build(**COVERED[name])
    fast = FastDecoder(model)
    ids = torch.randint(0, 61, (3, 10), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(fast(ids), model(ids), atol=1e-5)
    # a left-padded batch through a cache: prefill, then three decode steps
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :7] = 0
    caches = []
    for _ in range(2):
        cache = KVCache.for_model(model.config, 3, 16)
        cache.set_padding(mask)
        caches.append(cache)
    assert torch.allclose(fast(ids, cache=caches[0]), model(ids, cache=caches[1]), atol=1e-5)
    for step in range(3):
        nxt = torch.tensor([[5], [7], [11 + step]])
        a = fast(nxt, cache=caches[0], last_only=True)
        b = model(nxt, cache=caches[1], last_only=True)
        assert a.shape == (3, 1, 61) and torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(norm_position="post"), "post-norm"),
        (dict(parallel_block=True), "parallel"),
        (dict(mlp="moe", n_experts=2, experts_top_k=1), "MLP module"),
    ],
)
def test_other_configs_fall_back_to_the_model(overrides, reason):
    model = build("llama-micro", **overrides)
    assert reason in FastDecoder.unsupported(model)
    with pytest.raises(ValueError, match="does not cover"):
        FastDecoder(model)
    engine = Engine(model, max_batch=2, eos_ids=[])
    assert engine.forward is engine.model  # the model's own forward
    lm = LM(model)
    prompts = [[1, 2, 3], [4, 5]]
    ref = lm.generate(prompts, max_new_tokens=5, temperature=0.0, eos_ids=[])
    params = GenerationParams(max_new_tokens=5, temperature=0.0)
    assert [c.token_ids for c in engine.generate(prompts, params)] == ref


def test_engine_uses_the_fast_decoder_and_keeps_weights_live():
    model = build("llama-micro")
    engine = Engine(model, max_batch=2, eos_ids=[])
    assert isinstance(engine.forward, FastDecoder) and engine.model is model
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        model.blocks[0].mlp.up_proj.weight.mul_(2.0)  # e.g. a training step in between
        model.blocks[0].attn_norm.weight.add_(0.5)
    with torch.inference_mode():
        assert torch.allclose(engine.forward(ids), model(ids), atol=1e-5)
