import math

import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.model.positions import RotaryEmbedding, rope_inv_freq, yarn_mscale


def test_ntk_spec_vectors():
    inv_freq, mscale = rope_inv_freq(4, 10000.0, {"rope_type": "ntk", "factor": 4.0})
    assert torch.allclose(inv_freq, torch.tensor([1.0, 0.0025]))  # b' = 160000
    assert mscale == 1.0
    inv_freq, _ = rope_inv_freq(128, 10000.0, {"rope_type": "ntk", "factor": 4.0})
    base = 1 / inv_freq[1].double() ** (128 / 2)  # inv_freq[1] = b'^(-2/128)
    assert base.item() == pytest.approx(40889.94, rel=1e-4)


def test_yarn_mscale_spec_vectors():
    assert [round(yarn_mscale(s), 6) for s in (2, 4, 16)] == [1.069315, 1.138629, 1.277259]
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(0.5) == 1.0


def test_yarn_direction_high_freq_kept_low_freq_interpolated():
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512}
    inv_freq, mscale = rope_inv_freq(64, 10000.0, scaling)
    plain, _ = rope_inv_freq(64, 10000.0)
    assert torch.allclose(inv_freq[:4], plain[:4])  # rotate many times in L: unchanged
    assert torch.allclose(inv_freq[-4:], plain[-4:] / 8)  # rotate < once in L: divided by s
    assert mscale == pytest.approx(0.1 * math.log(8) + 1)


def test_linear_is_position_interpolation():
    inv_freq, _ = rope_inv_freq(8, 10000.0, {"rope_type": "linear", "factor": 4.0})
    assert torch.allclose(inv_freq, rope_inv_freq(8, 10000.0)[0] / 4)


def _hf_config(rope_scaling, max_pos=64, head_dim=16, theta=10000.0):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_pos,
        rope_theta=theta, rope_scaling=rope_scaling,
    )  # fmt: skip


CASES = {
    "linear": ({"rope_type": "linear", "factor": 3.0}, {}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, {}),
    "yarn_options": (
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 8,
            "beta_slow": 2,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
            "truncate": False,
        },
        {},
    ),  # fmt: skip
    "yarn_attention_factor": (
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 16,
            "attention_factor": 1.5,
        },
        {},
    ),  # fmt: skip
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        {"theta": 500000.0},
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers_rope_init_functions(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling, kw = CASES[name]
    config = _hf_config(dict(scaling), **kw)
    ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    ours, scale = rope_inv_freq(16, kw.get("theta", 10000.0), scaling)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-6)


@pytest.mark.parametrize("seq_len", [10, 64, 65, 100, 250])
def test_dynamic_matches_transformers(seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _hf_config({"rope_type": "dynamic", "factor": 2.0}, max_pos=64)
    ref, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=seq_len)
    scaling = {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    ours, _ = rope_inv_freq(16, 10000.0, scaling, seq_len=seq_len)
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0)


def test_dynamic_tables_grow_only_past_the_original_context():
    scaling = {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 8}
    rope = RotaryEmbedding(8, 32, scaling=scaling)
    plain = RotaryEmbedding(8, 32)
    short = torch.arange(8)
    assert torch.equal(rope.tables(short, torch.float32)[0], plain.tables(short, torch.float32)[0])
    long = torch.arange(20)
    cos, _ = rope.tables(long, torch.float32)
    freq, _ = rope_inv_freq(8, 10000.0, scaling, seq_len=20)
    assert torch.allclose(cos[19, :4], torch.cos(19 * freq))
    assert not torch.allclose(cos, plain.tables(long, torch.float32)[0])


def test_yarn_mscale_folded_into_cos_sin():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    cos, sin = RotaryEmbedding(8, 32, scaling=scaling).tables(torch.arange(32), torch.float32)
    assert torch.allclose(cos**2 + sin**2, torch.full_like(cos, yarn_mscale(4.0) ** 2))


def test_bad_scaling_configs_fail_at_build_time():
    with pytest.raises(ConfigError, match="unknown rope_scaling type 'warp'; supported: default"):
        RotaryEmbedding(8, 16, scaling={"rope_type": "warp", "factor": 2})
    with pytest.raises(ConfigError, match="'yarn' needs original_max_position_embeddings"):
        RotaryEmbedding(8, 16, scaling={"rope_type": "yarn", "factor": 2})
    # old configs spell the key "type"
    assert rope_inv_freq(8, 10000.0, {"type": "linear", "factor": 2.0})[0][0] == 0.5
