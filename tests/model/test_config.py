import pytest

from lmforge.errors import ConfigError
from lmforge.model.attention import ATTENTION_KERNELS
from lmforge.model.blocks import ATTENTION_CLASSES, BRANCH_SCALES, NORM_POSITIONS
from lmforge.model.config import PRESETS, ModelConfig
from lmforge.model.feedforward import MLP_KINDS
from lmforge.model.info import (
    flops_per_token,
    kv_cache_bytes_per_token,
    kv_cache_elements,
    parameter_counts,
)
from lmforge.model.linear_attention import FEATURE_MAP_NAMES
from lmforge.model.norms import NORM_CLASSES
from lmforge.model.positions import POSITION_KINDS
from lmforge.model.transformer import Transformer


def test_defaults_and_derived_fields():
    c = ModelConfig(d_model=64, n_head=4)
    assert c.n_kv_head == 4 and c.head_dim == 16 and c.d_ff == 256
    glu = ModelConfig(d_model=768, n_head=12, mlp="swiglu")
    assert glu.d_ff == 2048  # 8/3 * 768 rounded up to a multiple of 64


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n_head=4, n_kv_head=3), "n_kv_head"),
        (dict(pos="rope", d_model=12, n_head=4, head_dim=3), "head_dim"),
        (dict(norm="batchnorm"), "norm"),
        (dict(mlp="tanh"), "mlp"),
        (dict(dropout=1.5), "dropout"),
        (dict(n_layer=0), "n_layer"),
    ],
)
def test_invalid_configs_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**kwargs)


@pytest.mark.parametrize(
    "field, registry",
    [("norm", NORM_CLASSES), ("pos", POSITION_KINDS), ("mlp", MLP_KINDS),
     ("attn_impl", ATTENTION_KERNELS), ("attention", ATTENTION_CLASSES),
     ("norm_position", NORM_POSITIONS), ("parallel_scale", BRANCH_SCALES),
     ("linear_feature_map", FEATURE_MAP_NAMES)],
)  # fmt: skip
def test_choices_are_the_component_registries(field, registry):
    """One source of truth: every registry key builds a model, and the error for anything else
    lists exactly the registry's keys."""
    for key in registry:
        extra = {"attention": "linear"} if field == "linear_feature_map" else {}
        tiny = dict(vocab_size=16, n_layer=1, d_model=16, n_head=2)
        Transformer(ModelConfig(**tiny, **{field: key}, **extra))
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{field: "no-such-kind"})
    assert str(err.value) == f"{field} must be one of {', '.join(registry)}; got 'no-such-kind'"


def test_unknown_keys_list_valid_ones():
    with pytest.raises(ConfigError, match="n_layers.*valid keys: .*n_layer"):
        ModelConfig.from_dict({"n_layers": 3})


def test_presets_span_1m_to_1b():
    sizes = {name: parameter_counts(ModelConfig.from_preset(name))["total"] for name in PRESETS}
    assert min(sizes.values()) < 2_000_000
    assert max(sizes.values()) > 1_000_000_000
    assert sizes["gpt2-small"] == 124_439_808  # Hugging Face's GPT-2 small
    assert sizes["llama-7b"] == 6_738_415_616  # Llama-2-7B


@pytest.mark.parametrize("name", ["gpt2-micro", "llama-micro"])
def test_counts_match_the_built_model(name):
    config = ModelConfig.from_preset(name)
    assert parameter_counts(config)["total"] == Transformer(config).num_parameters()


def test_kv_cache_spec_vector():
    mha = kv_cache_elements(batch=1, n_kv_head=32, seq_len=4096, head_dim=128)
    mqa = kv_cache_elements(batch=1, n_kv_head=1, seq_len=4096, head_dim=128)
    assert mha == 33_554_432 and mha * 2 == 64 * 2**20
    assert mqa == 1_048_576 and mqa * 2 == 2 * 2**20
    c = ModelConfig.from_preset("llama-1b")
    assert kv_cache_bytes_per_token(c) == 2 * 16 * 8 * 64 * 2


def test_flops_grow_with_context():
    c = ModelConfig.from_preset("gpt2-small")
    short, long = flops_per_token(c, 128), flops_per_token(c, 1024)
    assert long["forward"] > short["forward"]
    assert short["training"] == 3 * short["forward"]
