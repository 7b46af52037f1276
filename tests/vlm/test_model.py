import json

import pytest
import torch
import torch.nn.functional as F

from lmforge.errors import CheckpointError, ConfigError, DataError
from lmforge.infer.params import GenerationParams
from lmforge.model.config import ModelConfig
from lmforge.vlm.model import IGNORE, IMAGE, VisionLanguageModel, build_vlm_tokenizer
from lmforge.vlm.vision import VisionConfig

WORDS = "a two three red green blue circle circles square squares left of above"


def tiny(pos="rope", use_cls=False, projector="linear", patch_embed="linear", **text):
    tok = build_vlm_tokenizer([WORDS])
    text_cfg = ModelConfig(
        vocab_size=tok.vocab_size, d_model=32, n_layer=2, n_head=4, max_seq_len=64, pos=pos,
        **text,
    )  # fmt: skip
    vision = VisionConfig(
        image_size=16, patch_size=8, d_model=16, n_head=2, use_cls=use_cls, patch_embed=patch_embed
    )
    return VisionLanguageModel.build(text_cfg, vision, tok, projector=projector).eval()


def test_prompt_layout_images_first_or_among_text():
    vlm = tiny()
    n = vlm.tokens_per_image
    ids = vlm.encode_prompt("two red", 1)
    assert ids[:2] == [vlm.tokenizer.bos_id, vlm.start_id]
    assert ids[2 : 2 + n] == [vlm.image_id] * n and ids[2 + n] == vlm.end_id
    assert vlm.tokenizer.decode(ids[3 + n :]) == "two red"
    among = vlm.encode_prompt(f"red {IMAGE} left of {IMAGE}", 2)
    assert among.count(vlm.image_id) == 2 * n
    assert among[1] == vlm.tokenizer.token_to_id("red") and among[-1] == vlm.end_id


def test_more_images_than_slots_is_a_clear_error():
    vlm = tiny()
    with pytest.raises(DataError, match="3 images given but the prompt has 2 image slot"):
        vlm.encode_prompt(f"{IMAGE} and {IMAGE}", 3)
    with pytest.raises(DataError, match="2 image slot.* but 1 image"):
        vlm.encode_prompt(f"{IMAGE} and {IMAGE}", 1)
    ids = torch.tensor([vlm.encode_prompt("red", 1)])
    with pytest.raises(DataError, match="placeholder tokens but the images give"):
        vlm(ids, torch.randn(2, 3, 16, 16))
    with pytest.raises(DataError, match="no images were given"):
        vlm(ids)


def test_loss_mask_only_caption_targets():
    vlm = tiny()
    ids, labels = vlm.collate([vlm.encode_example("two red circles"), vlm.encode_example("a")])
    prompt_len = len(vlm.encode_prompt("", 1))
    assert (labels[:, :prompt_len] == IGNORE).all()  # BOS + image block never targets
    assert (labels[ids == vlm.image_id] == IGNORE).all()
    assert labels[0, prompt_len:].tolist() == vlm.tokenizer.encode("two red circles", add_eos=True)
    assert (labels[1, prompt_len + 2 :] == IGNORE).all()  # right padding

    pixels = torch.randn(2, 3, 16, 16)
    logits = vlm(ids, pixels).detach().requires_grad_(True)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, vlm.loss(ids, labels, pixels))
    loss.backward()
    # Logits whose next token is an image/prompt token get no gradient: the loss ignores them.
    assert logits.grad[:, : prompt_len - 1].abs().sum() == 0
    assert logits.grad[0, prompt_len - 1 :].abs().sum() > 0


def test_gradients_reach_vision_tower_and_projector():
    vlm = tiny().train()
    ids, labels = vlm.collate([vlm.encode_example("two red circles")])
    vlm.loss(ids, labels, torch.randn(1, 3, 16, 16)).backward()
    assert vlm.projector.proj.weight.grad.abs().sum() > 0
    assert vlm.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0


def test_features_land_exactly_on_placeholders():
    """Splicing the placeholder's own embedding gives the plain text-only forward pass."""
    vlm = tiny(pos="learned")
    ids = torch.tensor([vlm.encode_prompt("two red", 1)])
    own = vlm.language_model.embed.weight[vlm.image_id].expand(1, vlm.tokens_per_image, -1)
    torch.testing.assert_close(vlm(ids, features=own), vlm.language_model(ids))


def test_image_is_visible_only_after_its_position():
    vlm = tiny()
    ids = torch.tensor([vlm.encode_prompt(f"red {IMAGE} two", 1)])
    first = ids[0].tolist().index(vlm.image_id)
    a = vlm(ids, torch.randn(1, 3, 16, 16))
    b = vlm(ids, torch.randn(1, 3, 16, 16))
    torch.testing.assert_close(a[:, :first], b[:, :first])  # causal: text before the image
    assert not torch.allclose(a[:, -1], b[:, -1])


class ImagePrompted(torch.nn.Module):
    """The reference's view of a VLM: the LM with one batch of image features bound; a call
    whose ids hold image placeholders gets the features spliced in, and the placeholder id is
    never sampled (its logit is -inf)."""

    def __init__(self, vlm, features):
        super().__init__()
        self.vlm, self.features, self.config = vlm, features, vlm.config

    def forward(self, input_ids, attention_mask=None, cache=None, last_only=False):
        is_image = input_ids == self.vlm.image_id
        features = self.features if bool(is_image.any()) else None
        logits = self.vlm(input_ids, attention_mask=attention_mask, cache=cache,
                          last_only=last_only, features=features)  # fmt: skip
        logits[..., self.vlm.image_id] = float("-inf")
        return logits


def reference(vlm, reference_generate, pixels, prompts, n, temperature=0.0):
    with torch.no_grad():
        bound = ImagePrompted(vlm.eval(), vlm.image_features(pixels))
        params = GenerationParams(n, temperature, seed=3)
        eos = [vlm.tokenizer.eos_id] if vlm.tokenizer.eos_id is not None else []
        return reference_generate.generate(bound, prompts, params, eos, use_cache=False)


@pytest.mark.parametrize(
    "pos,use_cls,patch_embed",
    [("rope", False, "linear"), ("learned", True, "conv"), ("rope", False, "factorised")],
)
def test_engine_generation_with_image_prefix_equals_the_uncached_reference(
    pos, use_cls, patch_embed, reference_generate
):
    torch.manual_seed(1)
    vlm = tiny(pos=pos, use_cls=use_cls, patch_embed=patch_embed)
    pixels = torch.randn(3, 3, 16, 16)
    prompts = [vlm.encode_prompt(p, 1) for p in ("", "two", "red circles left")]  # left padding
    engine = vlm.generate(pixels, prompts, 12)
    assert engine == reference(vlm, reference_generate, pixels, prompts, 12)
    assert all(len(r) > 0 for r in engine)
    sampled = vlm.generate(pixels, prompts, 12, temperature=1.0, seed=3)
    assert sampled == vlm.generate(pixels, prompts, 12, temperature=1.0, seed=3)
    assert all(vlm.image_id not in r for r in sampled)


def test_cached_prefill_logits_match_full_recompute():
    vlm = tiny()
    from lmforge.model.cache import new_cache

    pixels = torch.randn(1, 3, 16, 16)
    ids = torch.tensor([vlm.encode_prompt("two red", 1)])
    full = vlm(ids, pixels)
    cache = new_cache(vlm.config, 1, ids.shape[1])
    prefix = vlm(ids[:, :-2], pixels, cache=cache)  # image prefix into the cache once
    rest = [vlm(ids[:, t : t + 1], cache=cache) for t in range(ids.shape[1] - 2, ids.shape[1])]
    torch.testing.assert_close(torch.cat([prefix, *rest], 1), full, atol=1e-5, rtol=1e-5)


def test_two_images_in_one_prompt_equal_the_uncached_reference(reference_generate):
    vlm = tiny()
    ids = vlm.encode_prompt(f"{IMAGE} left of {IMAGE}", 2)
    pixels = torch.randn(2, 3, 16, 16)
    assert vlm.generate(pixels, [ids], 8) == reference(vlm, reference_generate, pixels, [ids], 8)


@pytest.mark.parametrize(
    "projector,patch_embed", [("linear", "factorised"), ("mlp2", "linear"), ("linear", "conv")]
)
def test_save_load_round_trip(tmp_path, projector, patch_embed):
    vlm = tiny(projector=projector, patch_embed=patch_embed)
    vlm.save(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    assert meta["model_type"] == "lmforge-vlm" and meta["projector"] == projector
    assert meta["vision_config"]["patch_size"] == 8
    assert meta["vision_config"]["patch_embed"] == patch_embed
    assert (tmp_path / "tokenizer.json").is_file()
    back = VisionLanguageModel.load(tmp_path)
    ids = torch.tensor([vlm.encode_prompt("two", 1)])
    pixels = torch.randn(1, 3, 16, 16)
    torch.testing.assert_close(back(ids, pixels), vlm(ids, pixels))
    assert back.language_model.lm_head.weight is back.language_model.embed.weight


def test_load_errors(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        VisionLanguageModel.load(tmp_path / "missing")
    vlm = tiny()
    vlm.save(tmp_path)
    meta = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**meta, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="model_type is 'llama'"):
        VisionLanguageModel.load(tmp_path)
    meta["vision_config"]["d_model"] = 32
    (tmp_path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="has shape"):
        VisionLanguageModel.load(tmp_path)


def test_tokenizer_needs_image_tokens():
    from lmforge.tokenizer import Tokenizer

    plain = Tokenizer.train_word([WORDS], 64)
    with pytest.raises(ConfigError, match="lacks the image tokens"):
        VisionLanguageModel.build(ModelConfig(vocab_size=64), VisionConfig(), plain)
