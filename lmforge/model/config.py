"""ModelConfig: the one dataclass that describes every model lmforge builds.

Each field picks a small component (norm, position, MLP, attention) by name; the registries live
next to the components and are the only lists of valid names: validation reads them. It happens
here, when the config is built, so a bad combination fails before any tensor is allocated and the
message names the fields involved.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import ConfigError, require_choice, require_int, require_positive_ints
from lmforge.fileio import coerce_numbers
from lmforge.model.attention import ATTENTION_KERNELS
from lmforge.model.blocks import ATTENTION_CLASSES, BRANCH_SCALES, NORM_POSITIONS
from lmforge.model.feedforward import MLP_KINDS
from lmforge.model.linear_attention import FEATURE_MAP_NAMES
from lmforge.model.masks import build_pattern
from lmforge.model.mlp import MLP, GatedMLP
from lmforge.model.norms import NORM_CLASSES
from lmforge.model.positions import POSITION_KINDS


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer. Defaults give a tiny GPT-2-style model."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # None = n_head (MHA); 1 = MQA; divides n_head = GQA
    d_model: int = 128
    d_ff: int | None = None  # None = 4*d_model, or Llama's 8/3*d_model rounded for GLU MLPs
    head_dim: int | None = None  # None = d_model // n_head
    max_seq_len: int = 256
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    pos: str = "learned"
    rope_base: float = 10000.0
    rope_interleaved: bool = False  # False: HF "rotate_half" pairing; True: (x0,x1),(x2,x3) pairs
    rope_scaling: dict[str, Any] | None = None  # HF-style {"rope_type": "linear"|..., "factor": s}
    mlp: str = "gelu"
    bias: bool = True
    # Per-projection biases (Hugging Face families mix them); None follows `bias`. The LM head
    # never had a bias here, so it defaults to False whatever `bias` says.
    attention_bias: bool | None = None  # q/k/v projections (Qwen2: True with bias=False)
    attention_out_bias: bool | None = None  # o_proj
    mlp_bias: bool | None = None
    lm_head_bias: bool = False
    sliding_window: int | None = None  # Mistral: each query sees its `sliding_window` newest keys
    n_experts: int = 8  # mlp="moe": number of experts
    experts_top_k: int = 2  # mlp="moe": experts per token (Mixtral routing)
    capacity_factor: float | None = None  # mlp="moe": alpha in C = floor(alpha*k*N/E); None: no cap
    aux_loss_weight: float = 0.0  # mlp="moe": lambda of the load-balancing loss (0.01 typical)
    n_shared_experts: int = 0  # mlp="moe": always-on experts (DeepSeek)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    tie_embeddings: bool = True
    dropout: float = 0.0
    attn_impl: str = "sdpa"
    init_std: float = 0.02
    # residual-branch output projections (o_proj, down_proj) start at zero: each block starts as
    # the identity (modded-nanogpt; Zhang et al. 2019, "Fixup")
    zero_init_proj: bool = False
    # ---- the architecture catalogue: attention kinds, masks, block wiring ----
    attention: str = "softmax"  # softmax | linear | mla
    attention_pattern: dict[str, Any] | None = None  # {"type": "block_local", "block_size": 16}
    linear_feature_map: str = "elu"  # attention="linear": elu | relu | relu2 | exp | rff
    kv_lora_rank: int = 32  # attention="mla": latent size, what the cache stores per token
    q_lora_rank: int | None = None  # attention="mla": compress queries too (None: no)
    qk_rope_head_dim: int = 16  # attention="mla": the decoupled RoPE key/query dims
    norm_position: str = "pre"  # pre | post | sandwich
    parallel_block: bool = False  # GPT-J/PaLM: x + Attn(N(x)) + FFN(N(x))
    parallel_scale: str = "none"  # none | inv_sqrt2 | learnable (parallel branch scales)
    drop_path: float = 0.0  # stochastic depth per residual branch
    logit_scaling: bool = False  # divide the final-norm output by sqrt(d_model)
    # ---- Gemma (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical Size";
    # 2025, "Gemma 3 Technical Report") ----
    embed_scale: bool = False  # multiply the token embeddings by sqrt(d_model)
    attn_logit_softcap: float | None = None  # attention scores -> c * tanh(scores / c)
    final_logit_softcap: float | None = None  # LM-head logits -> c * tanh(logits / c)
    attn_scale: float | None = None  # query scale; None: 1 / sqrt(head_dim)
    # with sliding_window: the layers that still attend to every earlier key (Gemma 2 every
    # second layer, Gemma 3 every sixth); None: the window applies to every layer (Mistral)
    full_attention_layers: list[int] | None = None
    rope_local_base: float | None = None  # windowed layers' RoPE base (Gemma 3); None: rope_base
    extra: dict[str, Any] = field(default_factory=dict)  # free-form metadata (e.g. preset name)

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.head_dim is None:
            if self.n_head <= 0 or self.d_model % self.n_head:
                raise ConfigError(
                    f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                    "unless head_dim is given"
                )
            self.head_dim = self.d_model // self.n_head
        if self.d_ff is None:
            self.d_ff = default_d_ff(self.d_model, self.mlp)
        for name in ("attention_bias", "attention_out_bias", "mlp_bias"):
            if getattr(self, name) is None:
                setattr(self, name, self.bias)
        self.validate()

    @property
    def is_glu(self) -> bool:
        """A dense gated MLP (gate, up and down matrices)."""
        return MLP_KINDS[self.mlp][0] is GatedMLP

    def validate(self) -> None:
        """Check every field and cross-field rule; raise ConfigError naming the fields."""
        require_positive_ints(
            self, "vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "max_seq_len"
        )
        registries = dict(
            norm=NORM_CLASSES, pos=POSITION_KINDS, mlp=MLP_KINDS, attn_impl=ATTENTION_KERNELS,
            attention=ATTENTION_CLASSES, norm_position=NORM_POSITIONS,
            parallel_scale=BRANCH_SCALES, linear_feature_map=FEATURE_MAP_NAMES,
        )  # fmt: skip
        for name, allowed in registries.items():
            require_choice(name, getattr(self, name), allowed)
        if self.n_head % self.n_kv_head:
            raise ConfigError(
                f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})"
            )
        if self.pos == "rope" and self.head_dim % 2:
            raise ConfigError(f"pos='rope' needs an even head_dim, got head_dim={self.head_dim}")
        if self.pos == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"pos='sinusoidal' needs an even d_model, got {self.d_model}")
        for name in ("dropout", "drop_path"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("norm_eps", "rope_base"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        optional = ("attn_logit_softcap", "final_logit_softcap", "attn_scale", "rope_local_base",
                    "capacity_factor")  # fmt: skip
        for name in optional:
            if (value := getattr(self, name)) is not None and not value > 0:
                raise ConfigError(f"{name} must be None or > 0, got {value!r}")
        if self.aux_loss_weight < 0:
            raise ConfigError(f"aux_loss_weight must be >= 0, got {self.aux_loss_weight}")
        require_int("n_shared_experts", self.n_shared_experts, 0)
        if self.mlp == "moe" and not 1 <= self.experts_top_k <= self.n_experts:
            raise ConfigError(
                f"experts_top_k ({self.experts_top_k}) must be between 1 and "
                f"n_experts ({self.n_experts})"
            )
        if self.sliding_window is not None:
            require_int("sliding_window", self.sliding_window)
        else:
            for name in ("full_attention_layers", "rope_local_base"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} only applies with sliding_window")
        layers = self.full_attention_layers or []
        if not all(isinstance(i, int) and 0 <= i < self.n_layer for i in layers):
            raise ConfigError(
                f"full_attention_layers must be layer indices in [0, {self.n_layer}), "
                f"got {layers!r}"
            )
        build_pattern(self.attention_pattern)  # raises ConfigError naming the field
        if self.attention_pattern is not None and self.sliding_window is not None:
            raise ConfigError("give either attention_pattern or sliding_window, not both")
        if self.attention == "linear" and (
            self.attention_pattern is not None or self.sliding_window is not None
        ):
            raise ConfigError(
                "attention='linear' sums over every past key: it cannot use "
                "attention_pattern or sliding_window"
            )
        if self.attention == "mla":
            require_positive_ints(self, "kv_lora_rank", "qk_rope_head_dim")
            if self.pos == "rope" and self.qk_rope_head_dim % 2:
                raise ConfigError(
                    f"pos='rope' with attention='mla' needs an even qk_rope_head_dim, "
                    f"got {self.qk_rope_head_dim}"
                )
        if self.parallel_block and self.norm_position != "pre":
            raise ConfigError("parallel_block=True needs norm_position='pre' (one shared pre-norm)")

    @property
    def mixed_windows(self) -> bool:
        """Some layers attend through sliding_window and others to every key (Gemma 2/3)."""
        return self.sliding_window is not None and self.full_attention_layers is not None

    def windowed(self, layer: int) -> bool:
        """Whether layer `layer` sees only the sliding_window newest keys."""
        return self.sliding_window is not None and layer not in (self.full_attention_layers or ())

    @property
    def rope_dim(self) -> int:
        """Dimensions RoPE rotates per head: MLA rotates only its decoupled key/query part."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    # ---- (de)serialisation -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> ModelConfig:
        """Build from a dict, rejecting unknown keys with the list of valid ones."""
        valid = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - valid):
            raise ConfigError(
                f"{source}: unknown model config key(s) {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(valid))}"
            )
        data = coerce_numbers(cls, data, source)
        try:
            return cls(**data)
        except TypeError as err:  # wrong value types that dataclass construction trips on
            raise ConfigError(f"{source}: {err}") from err

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
        data = {**PRESETS[name], **overrides}
        data.setdefault("extra", {})["preset"] = name
        return cls.from_dict(data, source=f"preset {name}")


def default_d_ff(d_model: int, mlp: str, multiple_of: int = 64) -> int:
    """GPT-2 uses 4*d_model; GLU MLPs (and MoE's GLU experts) use 2/3 of that (Llama), rounded
    up to a multiple. (An unknown `mlp` fails validation, after this.)"""
    if MLP_KINDS.get(mlp, (MLP,))[0] is MLP:
        return 4 * d_model
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


_GPT2 = dict(pos="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
_LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)


def _preset(style: dict, layers: int, heads: int, width: int, ctx: int, vocab: int, **kw) -> dict:
    return dict(style, n_layer=layers, n_head=heads, d_model=width, max_seq_len=ctx,
                vocab_size=vocab, **kw)  # fmt: skip


# Named presets from ~1M to 7B parameters (`lmforge model-info --list`). vocab_size is a
# default: a run's tokenizer overrides it.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2-micro": _preset(_GPT2, 4, 4, 128, 256, 4096),
    "gpt2-mini": _preset(_GPT2, 6, 6, 384, 512, 8192),
    "gpt2-small": _preset(_GPT2, 12, 12, 768, 1024, 50257),
    "gpt2-medium": _preset(_GPT2, 24, 16, 1024, 1024, 50257),
    "gpt2-large": _preset(_GPT2, 36, 20, 1280, 1024, 50257),
    "gpt2-xl": _preset(_GPT2, 48, 25, 1600, 1024, 50257),
    "llama-micro": _preset(_LLAMA, 4, 4, 128, 256, 4096, n_kv_head=2),
    "llama-mini": _preset(_LLAMA, 8, 8, 512, 1024, 8192, n_kv_head=4, d_ff=1376),
    "llama-160m": _preset(_LLAMA, 12, 12, 768, 2048, 32000, n_kv_head=4, d_ff=2048),
    "llama-1b": _preset(_LLAMA, 16, 32, 2048, 4096, 128256, n_kv_head=8, d_ff=8192,
                        rope_base=500000.0, tie_embeddings=True),
    "llama-7b": _preset(_LLAMA, 32, 32, 4096, 4096, 32000, d_ff=11008),
}  # fmt: skip
