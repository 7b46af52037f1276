import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import ConfigError
from lmforge.vlm.vision import (
    FactorisedPatchEmbedding,
    PatchEmbedding,
    VisionConfig,
    VisionEncoder,
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
    with pytest.raises(ConfigError, match="expected pixels"):
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
    assert enc.num_tokens == 16 + use_cls


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
        VisionConfig(patch_embed="conv")
    enc = VisionEncoder(VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2))
    with pytest.raises(ConfigError, match="expected pixels"):
        enc(torch.randn(1, 3, 20, 20))
