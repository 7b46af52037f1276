import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import ConfigError, DataError
from lmforge.model.attention import CausalSelfAttention
from lmforge.model.transformer import Block
from lmforge.vlm.vision import (
    ConvPatchEmbedding,
    FactorisedPatchEmbedding,
    PatchEmbedding,
    VisionConfig,
    VisionEncoder,
    upgrade_legacy_names,
)


def test_patch_embedding_shapes_and_equals_linear_map_of_each_patch():
    cfg = VisionConfig(image_size=16, patch_size=4, d_model=8, n_head=2)
    embed = PatchEmbedding(cfg)
    x = torch.randn(2, 3, 16, 16)
    out = embed(x)
    assert out.shape == (2, 16, 8)
    # unfold -> [B, C*P*P, L] columns, row-major patches: the same linear map per patch.
    patches = F.unfold(x, kernel_size=4, stride=4).transpose(1, 2)
    ref = patches @ embed.proj.weight.flatten(1).T + embed.proj.bias
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_factorised_patch_embedding_separates_shape_from_colour():
    """The shape code ignores the colour and the colour code ignores the outline."""
    embed = FactorisedPatchEmbedding(
        VisionConfig(image_size=16, patch_size=8, d_model=8, n_head=2, patch_embed="factorised")
    )
    mask_a = torch.zeros(16, 16)
    mask_a[1:6, 1:6] = 1  # a square in patch 0
    mask_b = torch.zeros(16, 16)
    mask_b[1:6, 3] = 1
    mask_b[3, 1:6] = 1  # a cross in patch 0

    def paint(mask, rgb):
        background = torch.full((3, 16, 16), -0.9)
        return torch.where(mask.bool(), torch.tensor(rgb).view(3, 1, 1), background)[None]

    red_a, blue_a = paint(mask_a, [0.8, -0.7, -0.7]), paint(mask_a, [-0.6, -0.3, 0.9])
    red_b = paint(mask_b, [0.8, -0.7, -0.7])
    with torch.no_grad():
        colour_w = embed.colour.weight.clone()
        embed.colour.weight.zero_()  # shape code only
        torch.testing.assert_close(embed(red_a), embed(blue_a))
        assert not torch.allclose(embed(red_a), embed(red_b))
        embed.colour.weight.copy_(colour_w)
        embed.shape.weight.zero_()  # colour code (+ bias) only
        torch.testing.assert_close(embed(red_a), embed(red_b))
        assert not torch.allclose(embed(red_a), embed(blue_a))
    enc = VisionEncoder(
        VisionConfig(image_size=16, patch_size=8, d_model=8, n_head=2, patch_embed="factorised")
    )
    assert enc(red_a).shape == (1, 4, 8)
    with pytest.raises(DataError, match="expected pixels"):
        enc(torch.randn(1, 3, 20, 20))


@pytest.mark.parametrize("use_cls", [False, True])
def test_late_colour_blocks_never_see_colour(use_cls):
    """Recolouring a shape moves its own token by exactly the colour code's change and leaves
    every other token alone: the blocks saw only outlines."""
    torch.manual_seed(0)
    cfg = VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2, use_cls=use_cls,
                       patch_embed="late_colour")  # fmt: skip
    enc = VisionEncoder(cfg).eval()
    pixels = torch.full((1, 3, 16, 16), -0.9)
    pixels[0, :, 9:14, 1:6] = torch.tensor([0.8, -0.7, -0.7]).view(3, 1, 1)  # patch 2
    recoloured = pixels.clone()
    recoloured[0, :, 9:14, 1:6] = torch.tensor([-0.6, -0.3, 0.9]).view(3, 1, 1)
    with torch.no_grad():
        delta = enc(recoloured) - enc(pixels)
        code = enc.patch_embed.codes(recoloured)[1] - enc.patch_embed.codes(pixels)[1]
    patch = 2 + use_cls
    others = [i for i in range(delta.shape[1]) if i != patch]
    assert delta[0, others].abs().max() < 1e-6
    torch.testing.assert_close(delta[0, patch], code[0, 2])
    assert delta[0, patch].abs().max() > 1e-3


def test_zero_blocks_allowed_negative_refused():
    enc = VisionEncoder(VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2, n_layer=0))
    assert enc(torch.randn(1, 3, 16, 16)).shape == (1, 4, 16)
    with pytest.raises(ConfigError, match="n_layer must be an integer >= 0"):
        VisionConfig(n_layer=-1)


@pytest.mark.parametrize("use_cls", [False, True])
def test_encoder_tokens(use_cls):
    cfg = VisionConfig(image_size=32, patch_size=8, d_model=16, n_head=2, use_cls=use_cls)
    enc = VisionEncoder(cfg)
    assert enc(torch.randn(3, 3, 32, 32)).shape == (3, 16 + use_cls, 16)
    assert enc.config.num_tokens == 16 + use_cls


def test_encoder_is_bidirectional():
    """Changing the last patch changes the first patch's feature (no causal mask)."""
    enc = VisionEncoder(VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2)).eval()
    x = torch.randn(1, 3, 16, 16)
    y = x.clone()
    y[..., 8:, 8:] += 1.0
    assert not torch.allclose(enc(x)[0, 0], enc(y)[0, 0])


def test_freeze_keeps_eval_mode_and_no_grads():
    enc = VisionEncoder(VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2)).freeze()
    enc.train()
    assert not enc.training
    assert not any(p.requires_grad for p in enc.parameters())


def test_bad_config_and_bad_pixels():
    with pytest.raises(ConfigError, match="not divisible by vision.patch_size"):
        VisionConfig(image_size=30, patch_size=8)
    with pytest.raises(ConfigError, match="n_head"):
        VisionConfig(d_model=30, n_head=4)
    with pytest.raises(ConfigError, match="patch_embed must be one of"):
        VisionConfig(patch_embed="pixelshuffle")
    with pytest.raises(ConfigError, match="patch_size must be a power of 2"):
        VisionConfig(image_size=24, patch_size=6, patch_embed="conv")
    for stem in ("linear", "conv"):
        cfg = VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2, patch_embed=stem)
        enc = VisionEncoder(cfg)
        with pytest.raises(
            DataError, match=r"expected pixels \[B, 3, 16, 16\], got \(1, 3, 20, 20"
        ):
            enc(torch.randn(1, 3, 20, 20))
        with pytest.raises(DataError, match=r"got \(1, 4, 16, 16\)"):  # RGBA tensor
            enc(torch.randn(1, 4, 16, 16))
        with pytest.raises(DataError, match="expected pixels"):  # greyscale, no channel dim
            enc(torch.randn(1, 16, 16))


def test_blocks_are_the_shared_lmforge_block():
    """The encoder runs lmforge/model's Block (fused-QKV softmax attention, LayerNorm, MLP), not
    a private attention class; the HF CLIP/SigLIP tests check the numbers against transformers."""
    enc = VisionEncoder(VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2))
    assert len(enc.blocks) == 2
    assert all(isinstance(b, Block) and isinstance(b.attn, CausalSelfAttention) for b in enc.blocks)
    assert VisionConfig().n_layer >= 1


def test_conv_stem_shapes_and_receptive_field_crosses_patch_borders():
    """A pixel just left of the border between patch 0 and patch 1 changes patch 1's token with
    the convolutional stem (overlapping receptive fields), never with the linear one."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    y = x.clone()
    y[:, :, 2, 7] += 1.0  # patch (0, 0), last column
    for stem, crosses in (("conv", True), ("linear", False)):
        cfg = VisionConfig(image_size=32, patch_size=8, d_model=16, n_head=2, patch_embed=stem)
        embed = PATCH_STEMS[stem](cfg)
        with torch.no_grad():
            a, b = embed(x), embed(y)
        assert a.shape == (2, 16, 16)
        assert not torch.allclose(a[:, 0], b[:, 0])
        assert (not torch.allclose(a[:, 1], b[:, 1])) == crosses
        # Patch rows 2-3 lie beyond the stem's 15-pixel receptive field: untouched either way.
        torch.testing.assert_close(a[:, 8:], b[:, 8:], atol=1e-6, rtol=0)
    conv = ConvPatchEmbedding(VisionConfig(image_size=32, patch_size=8, d_model=16, n_head=2,
                                           patch_embed="conv"))  # fmt: skip
    assert sum(isinstance(m, torch.nn.Conv2d) for m in conv.modules()) == 4  # 3 x stride 2 + 1x1


PATCH_STEMS = {"linear": PatchEmbedding, "conv": ConvPatchEmbedding}


def test_legacy_block_names_load_into_the_shared_block():
    """Checkpoints written with the old private block names (norm1, attn.qkv, mlp.0, ...) are
    renamed onto the shared Block and give the same outputs."""
    torch.manual_seed(0)
    enc = VisionEncoder(VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2)).eval()
    new_to_old = {"attn_norm": "norm1", "mlp_norm": "norm2", "attn.qkv_proj": "attn.qkv",
                  "attn.o_proj": "attn.out", "mlp.up_proj": "mlp.0",
                  "mlp.down_proj": "mlp.2"}  # fmt: skip
    old = {}
    for name, tensor in enc.state_dict().items():
        for new, legacy in new_to_old.items():
            name = name.replace(f".{new}.", f".{legacy}.")
        old["vision_tower." + name] = tensor.clone()
    assert "vision_tower.blocks.0.mlp.0.weight" in old
    back = {k.removeprefix("vision_tower."): v for k, v in upgrade_legacy_names(old).items()}
    fresh = VisionEncoder(VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2)).eval()
    fresh.load_state_dict(back, strict=True)
    x = torch.randn(1, 3, 16, 16)
    torch.testing.assert_close(fresh(x), enc(x))
