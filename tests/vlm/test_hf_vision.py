import json

import pytest
import torch

from lmforge.errors import CheckpointError
from lmforge.vlm.hf_vision import hf_vision_config, load_hf_vision_tower

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=16, patch_size=8)  # fmt: skip


def _save(model, path):
    torch.manual_seed(0)
    with torch.no_grad():  # move LayerNorms off their 1/0 init so they are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("flavour", ["clip", "siglip"])
def test_matches_hugging_face_last_hidden_state(tmp_path, flavour):
    torch.manual_seed(0)
    if flavour == "clip":
        hf = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**TINY))
    else:
        hf = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**TINY))
    hf = _save(hf, tmp_path)
    ours = load_hf_vision_tower(tmp_path)
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = hf(pixel_values=pixels).last_hidden_state
        out = ours(pixels)
    assert out.shape == ref.shape == (2, 4 + (flavour == "clip"), 32)
    assert (out - ref).abs().max() <= 1e-4
    config, kind = hf_vision_config(tmp_path)
    assert kind == flavour and config.use_cls == (flavour == "clip")


def test_full_clip_model_directory(tmp_path):
    """A CLIPModel (text + vision) directory: weights under vision_model., vision_config."""
    torch.manual_seed(0)
    cfg = transformers.CLIPConfig(
        vision_config=TINY,
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            vocab_size=99,
        ),  # fmt: skip
        projection_dim=16,
    )
    hf = _save(transformers.CLIPModel(cfg), tmp_path)
    pixels = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        ref = hf.vision_model(pixel_values=pixels).last_hidden_state
        out = load_hf_vision_tower(tmp_path)(pixels)
    assert (out - ref).abs().max() <= 1e-4


def test_bad_directories(tmp_path):
    with pytest.raises(CheckpointError, match="HF model directory not found"):
        load_hf_vision_tower(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="not a CLIP or SigLIP model"):
        load_hf_vision_tower(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip_vision_model"}))
    with pytest.raises(CheckpointError, match="lacks the field 'image_size'"):
        load_hf_vision_tower(tmp_path)


def test_clip_tower_inside_a_vlm_saves_and_loads(tmp_path):
    """A loaded CLIP tower becomes the (frozen) vision tower of a VisionLanguageModel; the
    VLM checkpoint keeps its switches (QuickGELU, pre-norm, no final norm) and reloads equal."""
    from lmforge.model.config import ModelConfig
    from lmforge.model.transformer import Transformer
    from lmforge.vlm.model import VisionLanguageModel, build_vlm_tokenizer

    torch.manual_seed(0)
    _save(transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**TINY)), tmp_path / "clip")
    tower = load_hf_vision_tower(tmp_path / "clip")
    tok = build_vlm_tokenizer(["a red circle"])
    lm = Transformer(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=4,
                                 max_seq_len=32))  # fmt: skip
    vlm = VisionLanguageModel(lm, tower, tok, freeze_vision=True)
    vlm.save(tmp_path / "vlm")
    back = VisionLanguageModel.load(tmp_path / "vlm")
    ids = torch.tensor([vlm.encode_prompt("a red", 1)])
    pixels = torch.randn(1, 3, 16, 16)
    torch.testing.assert_close(back(ids, pixels), vlm.eval()(ids, pixels))
    assert back.vision_tower.config.act == "quick_gelu" and back.vision_tower.frozen


def test_train_config_can_use_a_pretrained_tower(tmp_path):
    from lmforge.errors import ConfigError
    from lmforge.vlm.train import VLMTrainConfig, build_data, build_vlm

    config = transformers.CLIPVisionConfig(**{**TINY, "image_size": 32})
    transformers.CLIPVisionModel(config).save_pretrained(tmp_path)
    cfg = VLMTrainConfig(vision_tower=str(tmp_path), freeze_vision=True, colours=4, shapes=3)
    vlm = build_vlm(cfg, build_data(cfg))
    assert vlm.tokens_per_image == 17 and vlm.vision_tower.frozen  # 16 patches + CLS
    assert vlm.projector.proj.in_features == 32
    with pytest.raises(ConfigError, match="image_size/patch_size \\(32, 8\\) differ"):
        bad = VLMTrainConfig(vision_tower=str(tmp_path), image_size=48)
        build_vlm(bad, build_data(bad))
