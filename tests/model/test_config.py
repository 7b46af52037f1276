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
    model_flops_utilisation,
    parameter_counts,
    peak_bf16_tflops,
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


def test_training_flops_and_mfu_match_nanogpts_estimate_mfu(nanogpt):
    """PaLM's 6N + 12 L H Q T, as nanoGPT's own model.py computes it (the oracle), on GPT-2
    small with the padded vocabulary; MFU of one 1,024-token sequence a second against the A100's
    312 TFLOPS is nanoGPT's estimate_mfu(1, 1.0). nanoGPT's N also holds the LayerNorms' 38k
    weights (not matmuls: ours leaves them out), hence the tolerance."""
    import torch

    with torch.device("meta"):  # shapes only: nothing allocated
        ref = nanogpt.GPT(nanogpt.GPTConfig(block_size=1024, vocab_size=50304, n_layer=12,
                                            n_head=12, n_embd=768, bias=True))  # fmt: skip
    ref_mfu = ref.estimate_mfu(fwdbwd_per_iter=1, dt=1.0)
    ours = flops_per_token(ModelConfig.from_preset("gpt2-small", vocab_size=50304), 1024)
    assert ours["training"] == pytest.approx(ref_mfu * 312e12 / 1024, rel=1e-3)
    assert model_flops_utilisation(1024, ours["training"], 312) == pytest.approx(ref_mfu, rel=1e-3)
    # without the attention term (12 L H Q T, 13% of GPT-2 small's at T = 1,024) it would fail
    assert ours["training"] - 12 * 12 * 12 * 64 * 1024 < ref_mfu * 312e12 / 1024 * 0.9


@pytest.mark.parametrize(
    "name, peak",
    [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835),
     ("NVIDIA H200", 989), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312),
     ("Tesla T4", None), ("NVIDIA GeForce RTX 3090", None)],
)  # fmt: skip
def test_peak_bf16_tflops_by_device_name(name, peak):
    assert peak_bf16_tflops(name) == peak
