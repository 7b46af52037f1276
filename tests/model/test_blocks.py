import math

import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import ConfigError
from lmforge.model.blocks import DropPath
from lmforge.model.config import ModelConfig
from lmforge.model.feedforward import build_mlp
from lmforge.model.io import load_lmforge_model, save_model
from lmforge.model.transformer import Transformer

BASE = dict(vocab_size=30, n_layer=1, d_model=16, n_head=2, pos="none")


def block_and_input(**kw):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**BASE, **kw)).eval()
    return model, model.blocks[0], torch.randn(2, 5, 16)


def run(block, h):
    return block(h, is_causal=True)


def attn(block, x):
    return block.attn(x, None, None, None, True, None)


def test_pre_norm_formula():
    _, b, h = block_and_input()
    h1 = h + attn(b, b.attn_norm(h))
    assert torch.allclose(run(b, h), h1 + b.mlp(b.mlp_norm(h1)), atol=1e-6)


def test_post_norm_formula():
    _, b, h = block_and_input(norm_position="post")
    h1 = b.attn_norm(h + attn(b, h))
    assert torch.allclose(run(b, h), b.mlp_norm(h1 + b.mlp(h1)), atol=1e-6)


@pytest.mark.parametrize("scale, expected", [("none", 1.0), ("inv_sqrt2", 1 / math.sqrt(2))])
def test_parallel_block_shares_one_norm(scale, expected):
    _, b, h = block_and_input(parallel_block=True, parallel_scale=scale)
    x = b.attn_norm(h)
    assert isinstance(b.mlp_norm, torch.nn.Identity)
    assert torch.allclose(run(b, h), h + expected * (attn(b, x) + b.mlp(x)), atol=1e-6)


def test_learnable_branch_scales_train_and_start_at_one():
    model, b, h = block_and_input(parallel_block=True, parallel_scale="learnable")
    assert isinstance(b.branch_scales, torch.nn.Parameter)
    assert torch.equal(b.branch_scales.detach(), torch.ones(2))
    model(torch.randint(0, 30, (1, 4))).sum().backward()
    assert b.branch_scales.grad.abs().sum() > 0
    assert "blocks.0.branch_scales" in model.state_dict()


def test_default_block_has_no_new_state():
    model, _, _ = block_and_input()
    assert not any("branch_scales" in k for k in model.state_dict())


@pytest.mark.parametrize(
    "kw", [dict(norm_position="post"), dict(parallel_block=True, parallel_scale="inv_sqrt2")]
)
def test_wiring_survives_save_and_load(tmp_path, kw):
    """Fixed branch scales are not in the checkpoint: loading (built on the meta device) must
    refill them, and every wiring must give the same logits after a round trip."""
    model, _, _ = block_and_input(**kw)
    save_model(model, tmp_path)
    ids = torch.randint(0, 30, (2, 7))
    assert torch.equal(load_lmforge_model(tmp_path)(ids), model(ids))


@pytest.mark.parametrize("field, value", [("norm_position", "peri"), ("parallel_scale", "half")])
def test_unknown_wiring_fails_at_config(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be one of"):
        ModelConfig(**{field: value})


def test_drop_path_drops_whole_samples_and_keeps_the_mean():
    torch.manual_seed(0)
    drop = DropPath(0.25).train()
    out = drop(torch.ones(4000, 3, 2))
    per_sample = out.flatten(1)
    assert torch.all((per_sample == 0).all(1) | (per_sample == 1 / 0.75).all(1))
    assert abs(out.mean().item() - 1.0) < 0.05
    assert torch.equal(drop.eval()(torch.ones(3, 2)), torch.ones(3, 2))


def test_logit_scaling_divides_by_sqrt_d_model():
    torch.manual_seed(0)
    plain = Transformer(ModelConfig(**BASE)).eval()
    scaled = Transformer(ModelConfig(**BASE, logit_scaling=True)).eval()
    scaled.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 30, (1, 6))
    assert torch.allclose(scaled(ids), plain(ids) / 4.0, atol=1e-6)


@pytest.mark.parametrize("kind, approximate", [("geglu", "none"), ("geglu_tanh", "tanh")])
def test_geglu_variants(kind, approximate):
    torch.manual_seed(0)
    mlp = build_mlp(kind, 8, 16, False, 0.0)
    x = torch.randn(3, 8)
    gate = F.gelu(mlp.gate_proj(x), approximate=approximate)
    assert torch.allclose(mlp(x), mlp.down_proj(gate * mlp.up_proj(x)), atol=1e-6)
    assert ModelConfig(mlp=kind).d_ff == 384  # Llama's 8/3 rule, like every GLU


@pytest.mark.parametrize("dims, shape", [(1, (8, 6)), (1, (8, 6, 5)), (2, (4, 6, 3, 5))])
def test_batchnorm_matches_torch_in_train_and_eval(spec_exhibits, dims, shape):
    ours = getattr(spec_exhibits, f"BatchNorm{dims}d")(6)
    theirs = getattr(torch.nn, f"BatchNorm{dims}d")(6)
    torch.manual_seed(0)
    for _ in range(3):
        x = torch.randn(shape) * 3 + 1
        assert torch.allclose(ours.train()(x), theirs.train()(x), atol=1e-5)
    assert torch.allclose(ours.running_var, theirs.running_var, atol=1e-5)
    x = torch.randn(shape)
    assert torch.allclose(ours.eval()(x), theirs.eval()(x), atol=1e-5)


def test_batchnorm_rejects_wrong_rank(spec_exhibits):
    with pytest.raises(ValueError, match="BatchNorm2d"):
        spec_exhibits.BatchNorm2d(3)(torch.randn(2, 3))
