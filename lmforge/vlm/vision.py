"""A ViT-style vision encoder: image -> one feature vector per patch (optionally a CLS vector too).

ViT (Dosovitskiy et al. 2021) cuts the image into P x P patches, embeds each with one linear map
(a Conv2d with kernel = stride = P is exactly that map applied to every patch), adds a learned
position embedding per patch and runs bidirectional pre-norm transformer blocks. The features
v_1..v_L go to the projector (projector.py) and become the image tokens of the language model.
The encoder can be trained with the LM or frozen (`freeze()`), as LLaVA does with CLIP.

The patch embedding is chosen by name (PATCH_EMBEDDINGS). Besides ViT's linear map there are
factorised ones that code a patch's outline and its colour separately. They exist for
compositional generalisation: on the synthetic shapes, captions of colour x shape pairs never seen
together in training were 52% exact with a factorised stem and 2 blocks, 86% when the blocks see
outlines only (late_colour), 96.5% with no blocks at all (vision_layers 0), after 3 CPU minutes
each: per-patch MLPs learn "purple triangle" as one feature and snap a blue triangle onto it.
The same switches (activation, norms, patch bias) let hf_vision.py load CLIP and SigLIP towers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError


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
    patch_embed: str = "linear"  # linear (ViT) | factorised | late_colour (see their classes)
    act: str = "gelu"  # MLP activation: gelu | gelu_tanh (SigLIP) | quick_gelu (CLIP)
    patch_bias: bool = True  # CLIP's patch embedding has no bias
    pre_norm: bool = False  # LayerNorm before the blocks (CLIP's pre_layrnorm)
    final_norm: bool = True  # LayerNorm after the blocks (CLIP's last_hidden_state has none)
    dropout: float = 0.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "channels", "d_model", "n_layer", "n_head"):
            value, low = getattr(self, name), int(name != "n_layer")  # 0 blocks: embeddings only
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"vision.{name} must be an integer >= {low}, got {value!r}")
        if self.image_size % self.patch_size:
            raise ConfigError(
                f"vision.image_size={self.image_size} is not divisible by "
                f"vision.patch_size={self.patch_size}"
            )
        if self.d_model % self.n_head:
            raise ConfigError(
                f"vision.d_model={self.d_model} is not divisible by vision.n_head={self.n_head}"
            )
        if self.patch_embed not in PATCH_EMBEDDINGS:
            raise ConfigError(
                f"vision.patch_embed must be one of {sorted(PATCH_EMBEDDINGS)}, "
                f"got {self.patch_embed!r}"
            )
        if self.act not in ACTIVATIONS:
            raise ConfigError(f"vision.act must be one of {sorted(ACTIVATIONS)}, got {self.act!r}")
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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "vision config") -> VisionConfig:
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - valid)
        if unknown:
            raise ConfigError(f"{source}: unknown vision field(s) {', '.join(unknown)}")
        return cls(**data)


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x): the GELU approximation OpenAI's CLIP was trained with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, type[nn.Module]] = {
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "quick_gelu": QuickGELU,
}


def check_pixels(pixels: torch.Tensor, image_size: int) -> None:
    if pixels.dim() != 4 or tuple(pixels.shape[-2:]) != (image_size,) * 2:
        raise ConfigError(
            f"expected pixels [B, C, {image_size}, {image_size}], "
            f"got {tuple(pixels.shape)} (resize images with lmforge.vlm.data.load_image)"
        )


class PatchEmbedding(nn.Module):
    """[B, C, H, W] -> [B, (H/P)(W/P), d]: a linear map of each flattened P x P x C patch."""

    late_colour = False

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.image_size = config.image_size
        p = config.patch_size
        self.proj = nn.Conv2d(
            config.channels, config.d_model, kernel_size=p, stride=p, bias=config.patch_bias
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        check_pixels(pixels, self.image_size)
        return self.proj(pixels).flatten(2).transpose(1, 2)  # row-major patch order


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
    The token is W_s shape + W_c colour + b; the encoder blocks then work on both. This is local
    contrast normalisation plus colour statistics, and works on any RGB image.
    """

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.image_size, self.p = config.image_size, config.patch_size
        self.shape = nn.Linear(self.p * self.p, config.d_model)
        self.colour = nn.Linear(2 * config.channels, config.d_model, bias=False)

    late_colour = False

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        shape, colour = self.codes(pixels)
        return shape + colour

    def codes(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_s outline + b, W_c colour), each [B, L, d]."""
        check_pixels(pixels, self.image_size)
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


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention (every patch sees every patch) via SDPA."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out = nn.Linear(config.d_model, config.d_model)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=False)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class VisionBlock(nn.Module):
    """Pre-norm ViT block: x + Attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model, eps=config.norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.d_ff),
            ACTIVATIONS[config.act](),
            nn.Linear(config.d_ff, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    """Pixels [B, C, H, W] in [-1, 1] -> features [B, num_tokens, d_model] (CLS first if used)."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PATCH_EMBEDDINGS[config.patch_embed](config)
        self.cls = nn.Parameter(torch.zeros(1, 1, config.d_model)) if config.use_cls else None
        self.pos = nn.Parameter(torch.randn(1, config.num_tokens, config.d_model) * 0.02)
        d, eps = config.d_model, config.norm_eps
        self.pre_norm = nn.LayerNorm(d, eps=eps) if config.pre_norm else nn.Identity()
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(d, eps=eps) if config.final_norm else nn.Identity()
        self.frozen = False

    @property
    def d_out(self) -> int:
        return self.config.d_model

    @property
    def num_tokens(self) -> int:
        return self.config.num_tokens

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        late = None
        if self.patch_embed.late_colour:  # added after the blocks (LateColourPatchEmbedding)
            x, late = self.patch_embed.codes(pixels)
        else:
            x = self.patch_embed(pixels)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pre_norm(x + self.pos)
        for block in self.blocks:
            x = block(x)
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
    "factorised": FactorisedPatchEmbedding,
    "late_colour": LateColourPatchEmbedding,
}
VISION_ENCODERS = {"vit": VisionEncoder}
