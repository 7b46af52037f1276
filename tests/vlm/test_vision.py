import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import ConfigError
from lmforge.vlm.vision import PatchEmbedding, VisionConfig, VisionEncoder


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
    enc = VisionEncoder(VisionConfig(image_size=16, patch_size=8, d_model=16, n_head=2))
    with pytest.raises(ConfigError, match="expected pixels"):
        enc(torch.randn(1, 3, 20, 20))
