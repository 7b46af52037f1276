"""VisionLanguageModel: a vision encoder, a projector and lmforge's causal Transformer, with images
as tokens in the text sequence (LLaVA-style: Liu et al. 2023, Visual Instruction Tuning).

A prompt holds one block per image, `<|im_start|> <|image|> x N <|im_end|>`, before or among the
text tokens. The placeholder ids embed like any token; a forward hook on the LM's `embed` then
replaces the placeholder rows with the projected image features, so the rest of the forward pass
is the unchanged text path of Transformer.hidden_states: joint positions (image tokens take
positions like text tokens), the causal mask, RoPE, the KV cache. The loss is next-token cross
entropy on text targets only; image positions and the prompt carry the label -100.

Checkpoints use a Hugging Face-like layout: config.json (text_config, vision_config, projector),
model.safetensors (language_model.* / vision_tower.* / projector.*), tokenizer.json.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from lmforge.errors import CheckpointError, ConfigError, DataError
from lmforge.fileio import check_state, load_tensors, read_json, save_tensors, write_json
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.tokenizer import DEFAULT_SPECIAL_TOKENS, Tokenizer
from lmforge.train.checkpoint import model_state
from lmforge.train.pretrain import TOKENIZER_KINDS, train_tokenizer
from lmforge.vlm.projector import build_projector
from lmforge.vlm.vision import VisionConfig, VisionEncoder, upgrade_legacy_names

VLM_MODEL_TYPE = "lmforge-vlm"
IMAGE = "<|image|>"  # one placeholder per image feature vector; also the slot mark in prompts
IMAGE_TOKENS = {"image": IMAGE, "im_start": "<|im_start|>", "im_end": "<|im_end|>"}
IGNORE = -100


def build_vlm_tokenizer(
    texts: Sequence[str], kind: str = "whitespace", vocab_size: int = 512
) -> Tokenizer:
    """A tokenizer whose special tokens include the image tokens. Kinds: "whitespace" (one id
    per whitespace-separated word, decoded joined by single spaces: the shortest sequences for
    captions), or lmforge's "word", "char" and "bpe"."""
    specials = {**DEFAULT_SPECIAL_TOKENS, **IMAGE_TOKENS}
    if kind == "whitespace":
        return _whitespace_tokenizer(texts, specials)
    if kind not in TOKENIZER_KINDS:
        raise ConfigError(f"tokenizer must be whitespace, word, char or bpe; got {kind!r}")
    return train_tokenizer(kind, texts, vocab_size, specials, min_frequency=1)


def _whitespace_tokenizer(texts: Sequence[str], specials: dict[str, str]) -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(specials.values())}
    for word in sorted({w for text in texts for w in text.split()}):
        vocab.setdefault(word, len(vocab))
    backend = Backend(models.WordLevel(vocab, unk_token=specials["unk"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # no decoder: joins with spaces
    backend.add_special_tokens(Tokenizer._added(specials))
    return Tokenizer(backend, "whitespace", specials)


def check_placeholders(count: int, features: torch.Tensor) -> None:
    """DataError unless `count` image placeholders take exactly the feature vectors of
    `features` [n_images, N, d_model]."""
    n, per_image = features.shape[:2]
    if count != n * per_image:
        raise DataError(f"the prompts hold {count} image placeholder tokens but the images give "
                        f"{n} x {per_image} = {n * per_image}")  # fmt: skip


def spliced_embeddings(lm: Transformer, is_image: torch.Tensor, features: torch.Tensor):
    """A hook on lm.embed, for a `with` block (torch's RemovableHandle removes it on exit): the
    text embeddings' rows where `is_image` [B, T] is True are replaced, in row-major order, by
    `features` [n_images, N, d_model]."""
    check_placeholders(int(is_image.sum()), features)

    def hook(module, inputs, out):
        return out.masked_scatter(is_image.unsqueeze(-1), features.to(out.dtype))

    return lm.embed.register_forward_hook(hook)


class VisionLanguageModel(nn.Module):
    """Vision encoder -> projector -> image tokens in a causal LM; plus its tokenizer."""

    def __init__(
        self,
        language_model: Transformer,
        vision_tower: VisionEncoder,
        tokenizer: Tokenizer,
        projector: str = "linear",
        freeze_vision: bool = False,
    ):
        super().__init__()
        if missing := [t for t in IMAGE_TOKENS.values() if tokenizer.token_to_id(t) is None]:
            raise ConfigError(
                f"the tokenizer lacks the image tokens {missing} (build_vlm_tokenizer)"
            )
        if tokenizer.vocab_size > language_model.config.vocab_size:
            raise ConfigError(
                f"vocab_size={language_model.config.vocab_size} is smaller than the tokenizer's "
                f"{tokenizer.vocab_size} tokens"
            )
        self.language_model = language_model
        self.vision_tower = vision_tower
        d_vision, d_text = vision_tower.config.d_model, language_model.config.d_model
        self.projector = build_projector(projector, d_vision, d_text)
        self.projector_kind = projector
        self.tokenizer = tokenizer
        self.image_id = tokenizer.token_to_id(IMAGE)
        self.start_id = tokenizer.token_to_id(IMAGE_TOKENS["im_start"])
        self.end_id = tokenizer.token_to_id(IMAGE_TOKENS["im_end"])
        self.freeze_vision = freeze_vision
        if freeze_vision:
            vision_tower.freeze()

    @classmethod
    def build(
        cls, text_config: ModelConfig, vision_config: VisionConfig, tokenizer: Tokenizer, **kw
    ) -> VisionLanguageModel:
        """A randomly initialised model (seed torch first for reproducibility); `kw` are the
        constructor's projector and freeze_vision."""
        return cls(Transformer(text_config), VisionEncoder(vision_config), tokenizer, **kw)

    @property
    def config(self) -> ModelConfig:
        return self.language_model.config

    @property
    def tokens_per_image(self) -> int:
        return self.vision_tower.config.num_tokens

    # ---------------------------------------------------------------- prompts

    def encode_prompt(self, text: str = "", n_images: int = 1, add_bos: bool = True) -> list[int]:
        """Token ids with one image block per image. Each literal `<|image|>` in `text` is an
        image slot; with no slot in the text, the images come before it."""
        pieces = text.split(IMAGE)
        slots = len(pieces) - 1
        if slots == 0:  # images first: n_images empty pieces, then the text
            pieces, slots = [""] * n_images + [text], n_images
        if n_images > slots:
            raise DataError(f"{n_images} images given but the prompt has {slots} image slot(s)")
        if n_images < slots:
            raise DataError(f"the prompt has {slots} image slot(s) but {n_images} image(s) given")
        ids = [self.tokenizer.bos_id] if add_bos else []
        for i, piece in enumerate(pieces):
            if i:  # an image block: <|im_start|> <|image|> x N <|im_end|>
                ids += [self.start_id, *[self.image_id] * self.tokens_per_image, self.end_id]
            if piece:
                ids += self.tokenizer.encode(piece)
        return ids

    def encode_example(self, caption: str, prompt: str = "") -> tuple[list[int], list[int]]:
        """(ids, labels) for training: labels are -100 on the prompt and image tokens and equal
        the ids on the caption and its EOS (the only targets)."""
        prompt_ids = self.encode_prompt(prompt, 1)
        target = self.tokenizer.encode(caption, add_eos=True)
        return prompt_ids + target, [IGNORE] * len(prompt_ids) + target

    def collate(self, examples: Sequence[tuple[list[int], list[int]]]):
        """Right-padded ids [B, T] and labels [B, T] (padding labelled -100)."""
        pad = self.tokenizer.pad_id or 0
        ids = pad_sequence([torch.tensor(x, dtype=torch.long) for x, _ in examples], True, pad)
        labels = [torch.tensor(y, dtype=torch.long) for _, y in examples]
        return ids, pad_sequence(labels, True, IGNORE)

    # ---------------------------------------------------------------- forward and loss

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels [n_images, C, H, W] -> projected image tokens [n_images, N, d_model]."""
        return self.projector(self.vision_tower(pixels))

    def forward(
        self,
        input_ids: torch.Tensor,
        pixels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        last_only: bool = False,
        features: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab]. Image placeholders take the features of `pixels` (one image per
        image block, row by row) or precomputed `features`; text-only ids need neither."""
        is_image = input_ids == self.image_id
        if features is None and pixels is not None:
            features = self.image_features(pixels)
        if features is None and bool(is_image.any()):
            raise DataError("the ids hold image placeholders but no images were given")
        splice = nullcontext() if features is None else spliced_embeddings(
            self.language_model, is_image, features
        )  # fmt: skip
        with splice:
            return self.language_model(input_ids, attention_mask, cache=cache, last_only=last_only)

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, pixels: torch.Tensor):
        """Mean next-token cross entropy over positions whose target label is not -100."""
        logits = self(input_ids, pixels)
        return F.cross_entropy(
            logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE
        )

    # ---------------------------------------------------------------- generation

    @torch.no_grad()
    def generate(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> list[list[int]]:
        """New token ids per prompt, on the engine: each prompt's image placeholders take the
        next image's features (row by row) as prompt embeddings, prefilled once; decoding then
        feeds text tokens only. The placeholder id is never sampled: a generated one would have
        no image behind it."""
        from lmforge.infer.engine import Engine
        from lmforge.infer.params import GenerationParams
        from lmforge.model.modes import eval_mode

        prompts = [[int(t) for t in p] for p in prompts]
        width = max(len(p) for p in prompts)  # the engine refuses a prompt with no room left
        eos = [self.tokenizer.eos_id] if self.tokenizer.eos_id is not None else []
        params = GenerationParams(max_new_tokens, temperature, top_k, top_p, seed,
                                  suppress_token_ids=[self.image_id])  # fmt: skip
        with eval_mode(self):
            embeds = self.prompt_embeddings(prompts, self.image_features(pixels))
            max_len = min(self.config.max_seq_len, width + max_new_tokens)
            engine = Engine(self.language_model, max_batch=len(prompts), max_len=max_len,
                            eos_ids=eos)  # fmt: skip
            done = engine.generate(prompts, params, prompt_embeds=embeds)
        return [c.token_ids for c in done]

    def prompt_embeddings(
        self, prompts: list[list[int]], features: torch.Tensor
    ) -> list[torch.Tensor | None]:
        """Input embeddings [len(prompt), d_model] of each prompt that holds image
        placeholders (None for text-only ones): its token embeddings with the placeholders
        replaced by `features` [n_images, N, d_model], consumed in order, row by row."""
        device = self.language_model.embed.weight.device
        ids = torch.as_tensor([t for p in prompts for t in p], device=device)
        is_image = ids == self.image_id
        check_placeholders(int(is_image.sum()), features)
        text = self.language_model.embed(ids)
        embeds = text.masked_scatter(is_image[:, None], features.to(text.dtype))
        rows = embeds.split([len(p) for p in prompts])
        return [row if self.image_id in p else None for row, p in zip(rows, prompts)]

    def caption(
        self, pixels: torch.Tensor, prompt: str = "", max_new_tokens: int = 32, **sampling
    ) -> list[str]:
        """One caption per image (pixels [B, C, H, W]), each image prompted on its own row."""
        ids = self.encode_prompt(prompt, 1)
        rows = self.generate(pixels, [ids] * pixels.shape[0], max_new_tokens, **sampling)
        return [self.tokenizer.decode(r, skip_special_tokens=True).strip() for r in rows]

    # ---------------------------------------------------------------- save / load

    def save(self, path: str | Path) -> None:
        """config.json + model.safetensors + tokenizer files in `path`."""
        path = Path(path)
        save_tensors(path / "model.safetensors", model_state(self), metadata={"format": "pt"})
        write_json(
            path / "config.json",
            {
                "model_type": VLM_MODEL_TYPE,
                "text_config": self.config.to_dict(),
                "vision_config": asdict(self.vision_tower.config),
                "projector": self.projector_kind,
                "freeze_vision": self.freeze_vision,
                "image_token": IMAGE,
                "image_token_id": self.image_id,
                "tokens_per_image": self.tokens_per_image,
            },
        )
        self.tokenizer.save(path)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> VisionLanguageModel:
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory not found: {path}")
        meta = read_json(path / "config.json", "VLM config")
        if meta.get("model_type") != VLM_MODEL_TYPE:
            raise CheckpointError(
                f"{path / 'config.json'}: model_type is {meta.get('model_type')!r}, "
                f"expected {VLM_MODEL_TYPE!r} (a checkpoint written by `lmforge vlm train`)"
            )
        source = str(path / "config.json")
        text = ModelConfig.from_dict(meta["text_config"], source=source)
        vision = VisionConfig.from_dict(meta["vision_config"], source=source)
        tokenizer, freeze = Tokenizer.load(path), bool(meta.get("freeze_vision"))
        projector = meta.get("projector", "linear")
        model = cls.build(text, vision, tokenizer, projector=projector, freeze_vision=freeze)
        state = upgrade_legacy_names(load_tensors(path / "model.safetensors"))
        check_state(path / "model.safetensors", state, model_state(model))
        model.load_state_dict(state, strict=False)  # tied lm_head is stored once
        return model.to(device).eval()
