"""Every causal variant of the architecture catalogue (model/config.py) passes the same checks:
causality by autograd, cached = uncached decoding (also with left padding), one training step
lowers the loss; plus config validation naming the fields."""

import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.model.blocks import ATTENTION_CLASSES
from lmforge.model.cache import (
    CACHES,
    KVCache,
    LatentKVCache,
    LinearStateCache,
    RollingKVCache,
    new_cache,
)
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer

LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
VARIANTS = {
    "gpt2": dict(),
    "llama-gqa-untied": dict(n_kv_head=2, tie_embeddings=False, **LLAMA),
    "mqa-interleaved": dict(pos="rope", rope_interleaved=True, n_kv_head=1),
    "sinusoidal-relu": dict(pos="sinusoidal", mlp="relu"),
    "nopos-geglu": dict(pos="none", mlp="geglu"),
    "softmax-explicit": dict(attn_impl="explicit"),
    "linear-elu": dict(attention="linear", linear_feature_map="elu", **LLAMA),
    "linear-relu": dict(attention="linear", linear_feature_map="relu"),
    "linear-relu2": dict(attention="linear", linear_feature_map="relu2"),
    "linear-exp-gqa": dict(attention="linear", linear_feature_map="exp", n_kv_head=2),
    "linear-rff": dict(attention="linear", linear_feature_map="rff"),
    "mla-rope": dict(attention="mla", **LLAMA),
    "mla-qlora-learned": dict(attention="mla", q_lora_rank=16),
    "block-local": dict(attention_pattern={"type": "block_local", "block_size": 4}),
    "strided": dict(attention_pattern={"type": "strided", "stride": 3}, **LLAMA),
    "sliding-window": dict(sliding_window=4, **LLAMA),
    "post-norm": dict(norm_position="post"),
    "parallel-inv-sqrt2": dict(parallel_block=True, parallel_scale="inv_sqrt2", **LLAMA),
    "parallel-learnable": dict(parallel_block=True, parallel_scale="learnable"),
    "drop-path-logit-scaling": dict(drop_path=0.1, logit_scaling=True, norm="rmsnorm"),
}  # fmt: skip


def tiny(**kw) -> Transformer:
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=40, n_layer=2, d_model=32, n_head=4, max_seq_len=32, **kw)
    return Transformer(config).eval()


@pytest.mark.parametrize("name", VARIANTS)
def test_causality_by_autograd(name):
    """∂s_t/∂e_τ = 0 for τ > t, and ≠ 0 for some τ ≤ t."""
    model = tiny(**VARIANTS[name])
    ids = torch.randint(0, 40, (1, 10))
    captured = {}

    def keep(module, args, out):
        out.retain_grad()
        captured["e"] = out

    handle = model.embed.register_forward_hook(keep)
    logits = model(ids)
    handle.remove()
    t = 5
    logits[0, t].sum().backward()
    grad = captured["e"].grad[0].abs().sum(-1)
    assert torch.all(grad[t + 1 :] == 0)
    assert grad[t] > 0


@pytest.mark.parametrize("name", VARIANTS)
def test_engine_greedy_equals_uncached(name, reference_generate):
    """Every variant decodes on the engine (its fast or its per-kind path) to the tokens the
    plain uncached loop gives."""
    model = tiny(**VARIANTS[name])
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]  # different lengths: left padding
    params = GenerationParams(max_new_tokens=12, temperature=0.0)
    engine = [c.token_ids for c in Engine(model, max_batch=2, eos_ids=[]).generate(prompts, params)]
    assert engine == reference_generate.generate(model, prompts, params, use_cache=False)


@pytest.mark.parametrize("name", VARIANTS)
def test_cached_logits_equal_full_forward(name):
    model = tiny(**VARIANTS[name])
    ids = torch.randint(0, 40, (2, 14))
    full = model(ids)
    cache = new_cache(model.config, 2, 14)
    pieces = [model(ids[:, :6], cache=cache)]
    pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(6, 14)]
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_one_training_step_lowers_the_loss(name):
    model = tiny(**VARIANTS[name]).train()
    ids = torch.randint(0, 40, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def loss():
        logits = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 40), ids[:, 1:].reshape(-1))

    torch.manual_seed(1)
    before = loss()
    before.backward()
    opt.step()
    model.eval()  # compare without DropPath noise
    with torch.no_grad():
        assert loss() < before.detach()


@pytest.mark.parametrize(
    "kw, cache_type",
    [
        (dict(), KVCache),
        (dict(sliding_window=4), RollingKVCache),
        (dict(attention_pattern={"type": "block_local", "block_size": 4}), RollingKVCache),
        (dict(attention_pattern={"type": "strided", "stride": 4}), KVCache),
        (dict(attention="linear"), LinearStateCache),
        (dict(attention="mla"), LatentKVCache),
    ],
)
def test_each_attention_gets_the_cache_it_needs(kw, cache_type):
    cache = new_cache(ModelConfig(**kw), 2, 64)
    assert type(cache) is cache_type


def test_every_attention_kind_has_a_cache():
    assert CACHES.keys() == ATTENTION_CLASSES.keys()


def test_rolling_and_state_caches_do_not_grow_with_length():
    window = ModelConfig(sliding_window=8)  # a query needs its 7 predecessors: 7 slots
    full = new_cache(ModelConfig(), 1, 4096).nbytes()
    assert new_cache(window, 1, 4096).nbytes() == full * 7 // 4096
    linear = ModelConfig(attention="linear")
    assert new_cache(linear, 1, 64).nbytes() == new_cache(linear, 1, 4096).nbytes()


def test_prefix_lm_with_cache_equals_full_forward():
    """The prefix is prefilled bidirectionally into the cache, the rest decodes causally."""
    model = tiny(**LLAMA)
    ids = torch.randint(0, 40, (1, 10))
    full = model(ids, prefix_len=4)
    cache = new_cache(model.config, 1, 10)
    pieces = [model(ids[:, :4], cache=cache, prefix_len=4)]
    pieces += [model(ids[:, t : t + 1], cache=cache, prefix_len=4) for t in range(4, 10)]
    assert torch.allclose(torch.cat(pieces, 1), full, atol=1e-5)
    # the prefix really is bidirectional: a later prefix token changes an earlier output
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % 40
    assert not torch.allclose(model(other, prefix_len=4)[0, 0], full[0, 0])
    assert torch.allclose(model(other)[0, 0], model(ids)[0, 0])  # plain causal: unchanged


@pytest.mark.parametrize(
    "kw, fields",
    [
        (dict(n_head=4, n_kv_head=3), ["n_head", "n_kv_head"]),
        (dict(pos="rope", d_model=36, n_head=4), ["rope", "head_dim"]),
        (dict(attention="mla", pos="rope", qk_rope_head_dim=5), ["qk_rope_head_dim"]),
        (dict(attention="flash"), ["attention"]),
        (dict(attention="linear", sliding_window=8), ["linear", "sliding_window"]),
        (dict(linear_feature_map="tanh"), ["linear_feature_map"]),
        (dict(attention_pattern={"type": "strided"}), ["attention_pattern", "stride"]),
        (dict(norm_position="middle"), ["norm_position"]),
        (dict(parallel_block=True, norm_position="post"), ["parallel_block", "norm_position"]),
        (dict(drop_path=1.5), ["drop_path"]),
        (dict(mlp="moe", n_experts=2, experts_top_k=3), ["experts_top_k", "n_experts"]),
    ],
)
def test_invalid_combinations_fail_when_the_config_is_built(kw, fields):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**kw)
    for field in fields:
        assert field in str(err.value)


def test_config_round_trips_through_dict():
    config = ModelConfig(attention="mla", attention_pattern=None, parallel_block=True)
    assert ModelConfig.from_dict(config.to_dict()) == config
