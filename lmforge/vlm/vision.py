"""A ViT-style vision encoder: image -> one feature vector per patch (optionally a CLS vector too).

ViT (Dosovitskiy et al. 2021) cuts the image into P x P patches, embeds each with one linear map
(a Conv2d with kernel = stride = P is exactly that map applied to every patch), adds a learned
position embedding per patch and runs bidirectional pre-norm transformer blocks. The blocks are
lmforge's own decoder `Block` (lmforge/model: LayerNorm, fused-QKV softmax attention, GELU MLP)
called with `is_causal=False`, so every patch sees every patch. The features v_1..v_L go to the
projector (projector.py) and become the image tokens of the language model. The encoder can be
trained with the LM or frozen (`freeze()`), as LLaVA does with CLIP.

The patch embedding ("stem") is chosen by name (PATCH_EMBEDDINGS):
  linear       ViT's linear map of each flattened patch (the default; what CLIP/SigLIP use);
  conv         a convolutional stem (Xiao et al. 2021, "Early convolutions help transformers
               see better"): 3x3 stride-2 convolutions down to the patch grid, then a 1x1
               projection. Its receptive fields overlap, so an object cut by a patch border is
               still seen whole by the tokens on both sides;
  factorised,  hand-made codes (per-patch brightness outline + per-channel max/min colour) that
  late_colour  only suit flat-coloured shapes on a dark background, one object per patch: they
               were tuned on an earlier version of the synthetic shapes in which every shape sat
               alone in its own patch cell. Kept for comparison, never the default.
The same switches (activation, norms, patch bias) let hf_vision.py load CLIP and SigLIP towers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError, DataError, require_choice, require_int
from lmforge.model.config import ModelConfig
from lmforge.model.norms import LayerNorm
from lmforge.model.transformer import Block


@dataclass
class VisionConfig:
    """Hyper-parameters of the patch encoder. Defaults suit 48x48 synthetic images on a CPU."""

    image_size: int = 48
    patch_size: int = 8
    channels: int = 3
    d_model: int = 96
    n_layer: int = 2
    n_head: int = 4
    d_ff: int | None = None  # None = 4 * d_model
    use_cls: bool = False  # prepend a learned CLS token (its feature becomes an image token too)
    # linear (ViT) | conv (convolutional stem) | factorised | late_colour (flat-coloured
    # synthetic shapes only; see the module docstring)
    patch_embed: str = "linear"
    act: str = "gelu"  # MLP activation: gelu | gelu_tanh (SigLIP) | quick_gelu (CLIP)
    patch_bias: bool = True  # CLIP's patch embedding has no bias
    pre_norm: bool = False  # LayerNorm before the blocks (CLIP's pre_layrnorm)
    final_norm: bool = True  # LayerNorm after the blocks (CLIP's last_hidden_state has none)
    dropout: float = 0.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "channels", "d_model", "n_layer", "n_head"):
            # 0 blocks: embeddings only
            require_int(f"vision.{name}", getattr(self, name), int(name != "n_layer"))
        for whole, part in (("image_size", "patch_size"), ("d_model", "n_head")):
            if getattr(self, whole) % getattr(self, part):
                raise ConfigError(f"vision.{whole}={getattr(self, whole)} is not divisible by "
                                  f"vision.{part}={getattr(self, part)}")  # fmt: skip
        require_choice("vision.patch_embed", self.patch_embed, PATCH_EMBEDDINGS)
        require_choice("vision.act", self.act, ENCODER_ACTIVATIONS)
        p = self.patch_size
        if self.patch_embed == "conv" and (p < 2 or p & (p - 1)):
            raise ConfigError(
                f"vision.patch_embed='conv' halves the image per 3x3 stride-2 convolution: "
                f"vision.patch_size must be a power of 2 >= 2, got {p}"
            )
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_tokens(self) -> int:
        """Feature vectors per image: one per patch, plus CLS when used."""
        return self.grid**2 + int(self.use_cls)

    @classmethod
    def from_dict(cls, data: dict, source: str = "vision config") -> VisionConfig:
        if unknown := sorted(set(data) - {f.name for f in dataclasses.fields(cls)}):
            raise ConfigError(f"{source}: unknown vision field(s) {', '.join(unknown)}")
        return cls(**data)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): the GELU approximation OpenAI's CLIP was trained with."""
    return x * torch.sigmoid(1.702 * x)


ENCODER_ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")  # MLP activations of the encoder blocks


def check_pixels(pixels: torch.Tensor, image_size: int, channels: int = 3) -> None:
    """Refuse a pixel tensor that is not [B, channels, image_size, image_size]."""
    if pixels.dim() != 4 or tuple(pixels.shape[1:]) != (channels, image_size, image_size):
        raise DataError(
            f"expected pixels [B, {channels}, {image_size}, {image_size}], "
            f"got {tuple(pixels.shape)} (load images with lmforge.vlm.data.load_image)"
        )


class PatchEmbedding(nn.Module):
    """[B, C, H, W] -> [B, (H/P)(W/P), d]: a linear map of each flattened P x P x C patch."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        p = config.patch_size
        self.proj = nn.Conv2d(
            config.channels, config.d_model, kernel_size=p, stride=p, bias=config.patch_bias
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels).flatten(2).transpose(1, 2)  # row-major patch order


class ConvPatchEmbedding(nn.Module):
    """[B, C, H, W] -> [B, (H/P)(W/P), d]: a convolutional stem.

    log2(P) stages of Conv3x3 (stride 2, padding 1) + GELU bring the image down to the patch
    grid, widening the channels towards d; a 1x1 convolution then projects to d. Each token's
    receptive field reaches past its own patch (by 2^k - 1 pixels after k stages), so a shape
    that straddles a patch border, or a patch that holds parts of two shapes, is not cut into
    pieces that no single token sees whole.
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        stages = config.patch_size.bit_length() - 1  # patch_size = 2**stages (checked)
        widths = [config.channels] + [
            max(config.d_model >> (stages - 1 - i), 8) for i in range(stages)
        ]
        layers: list[nn.Module] = []
        for c_in, c_out in zip(widths, widths[1:]):
            layers += [nn.Conv2d(c_in, c_out, 3, stride=2, padding=1), nn.GELU()]
        self.stem = nn.Sequential(*layers)
        self.proj = nn.Conv2d(widths[-1], config.d_model, 1, bias=config.patch_bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(self.stem(pixels)).flatten(2).transpose(1, 2)  # row-major patches


class FactorisedPatchEmbedding(nn.Module):
    """[B, C, H, W] -> [B, (H/P)(W/P), d]: per patch, a shape code plus a colour code.

    A linear patch embedding sees colour times outline (pixel = colour where the shape is), so a
    "red triangle" patch is a point it never met if red triangles are absent from training: the
    features entangle the two and caption only the pairs seen. Here each patch is split into
    two parts, each blind to the other:
      shape:  per-pixel brightness (max over channels), min-max normalised within the patch:
              the outline in [0, 1] whatever its colour (a uniform patch gives zeros);
      colour: per-channel max and min over the patch: the brightest colour and the background,
              whatever the outline.
    The token is W_s shape + W_c colour + b; the encoder blocks then work on both.

    Specific to flat-coloured shapes on a dark background with at most one object per patch:
    the colour code is the patch's brightest and darkest value per channel, so a patch holding
    two objects gets a colour that belongs to neither, and natural images (shading, texture)
    have no such "colour". Off by default; use `linear` or `conv` for anything else.
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.p = config.patch_size
        self.shape = nn.Linear(self.p * self.p, config.d_model)
        self.colour = nn.Linear(2 * config.channels, config.d_model, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        shape, colour = self.codes(pixels)
        return shape + colour

    def codes(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_s outline + b, W_c colour), each [B, L, d]."""
        b, c = pixels.shape[:2]
        patches = F.unfold(pixels, self.p, stride=self.p).view(b, c, self.p * self.p, -1)
        patches = patches.permute(0, 3, 1, 2)  # [B, L, C, P*P], row-major patch order
        value = patches.amax(dim=2)  # [B, L, P*P]
        low, high = value.amin(-1, keepdim=True), value.amax(-1, keepdim=True)
        outline = (value - low) / (high - low).clamp_min(0.1)
        colour = torch.cat([patches.amax(-1), patches.amin(-1)], dim=-1)  # [B, L, 2C]
        return self.shape(outline), self.colour(colour)


class LateColourPatchEmbedding(FactorisedPatchEmbedding):
    """The factorised codes, but the encoder blocks see only the shape code; the colour code is
    added to their output. The blocks (attention + MLP) then cannot tie a colour to a shape at
    all: every image token is f(outlines) + W_c colour, and colour x shape pairs never seen in
    training are sums of parts that were."""

    late_colour = True

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.codes(pixels)[0]


def vision_block(config: VisionConfig, layer_idx: int) -> Block:
    """One bidirectional encoder block (call it with is_causal=False): lmforge's pre-norm Block
    with LayerNorm, biased fused-QKV softmax attention (no positions inside the blocks: the
    encoder adds its learned patch positions once) and a 2-layer GELU MLP. vocab_size is unused
    (no embedding here)."""
    block_config = ModelConfig(
        vocab_size=1, n_layer=max(config.n_layer, 1), n_head=config.n_head,
        d_model=config.d_model, d_ff=config.d_ff, max_seq_len=config.num_tokens,
        norm="layernorm", norm_eps=config.norm_eps, pos="none",
        mlp="gelu_tanh" if config.act == "gelu_tanh" else "gelu", bias=True,
        dropout=config.dropout, attn_impl="sdpa",
    )  # fmt: skip
    block = Block(block_config, layer_idx)
    if config.act == "quick_gelu":  # CLIP's activation is not one of the LM's MLP kinds
        block.mlp.act = quick_gelu
    return block


class VisionEncoder(nn.Module):
    """Pixels [B, C, H, W] in [-1, 1] -> features [B, num_tokens, d_model] (CLS first if used)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PATCH_EMBEDDINGS[config.patch_embed](config)
        self.cls = nn.Parameter(torch.zeros(1, 1, config.d_model)) if config.use_cls else None
        self.pos = nn.Parameter(torch.randn(1, config.num_tokens, config.d_model) * 0.02)
        d, eps = config.d_model, config.norm_eps
        self.pre_norm = LayerNorm(d, eps=eps) if config.pre_norm else nn.Identity()
        self.blocks = nn.ModuleList(vision_block(config, i) for i in range(config.n_layer))
        self.norm = LayerNorm(d, eps=eps) if config.final_norm else nn.Identity()
        self.frozen = False

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        check_pixels(pixels, self.config.image_size, self.config.channels)
        late = None
        if getattr(self.patch_embed, "late_colour", False):  # added after the blocks
            x, late = self.patch_embed.codes(pixels)
        else:
            x = self.patch_embed(pixels)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pre_norm(x + self.pos)
        for block in self.blocks:
            x = block(x, is_causal=False)  # no mask: every patch attends to every patch
        x = self.norm(x)
        if late is not None:
            x = x + F.pad(late, (0, 0, int(self.cls is not None), 0))  # none on CLS
        return x

    def freeze(self) -> VisionEncoder:
        """Stop training the encoder: no gradients, and eval mode kept by `train()`."""
        self.frozen = True
        self.requires_grad_(False)
        return self.eval()

    def train(self, mode: bool = True) -> VisionEncoder:
        return super().train(mode and not self.frozen)


PATCH_EMBEDDINGS: dict[str, type[nn.Module]] = {
    "linear": PatchEmbedding,
    "conv": ConvPatchEmbedding,
    "factorised": FactorisedPatchEmbedding,
    "late_colour": LateColourPatchEmbedding,
}


# Tensor names of the encoder blocks before they became lmforge's shared Block.
LEGACY_BLOCK_NAMES = {
    ".norm1.": ".attn_norm.", ".norm2.": ".mlp_norm.", ".attn.qkv.": ".attn.qkv_proj.",
    ".attn.out.": ".attn.o_proj.", ".mlp.0.": ".mlp.up_proj.", ".mlp.2.": ".mlp.down_proj.",
}  # fmt: skip


def upgrade_legacy_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename block tensors of checkpoints written before the shared Block (same maths: the
    old private block was the same pre-norm LayerNorm / fused-QKV attention / GELU MLP)."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("vision_tower.blocks."):  # a VisionLanguageModel checkpoint
            for old, new in LEGACY_BLOCK_NAMES.items():
                name = name.replace(old, new)
        out[name] = tensor
    return out
