"""Which parameter-efficient method a run uses (`peft: none | lora | qlora | adapter`), its
settings, and `apply_peft`, which wraps a model in place as the config says.

Targets use lmforge's module names. Attention has ONE fused `qkv_proj` Linear (not separate
q/k/v), so LoRA's usual "q,v" becomes `qkv_proj` (it adapts queries, keys and values together);
the default `qkv_proj,o_proj` adds the output projection. MLP layers are `up_proj`, `down_proj`
(and `gate_proj` for GLU MLPs). Bottleneck adapters follow each block's `mlp` by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from lmforge.errors import require_choice
from lmforge.peft.adapter import apply_adapters
from lmforge.peft.lora import apply_lora
from lmforge.peft.qlora import apply_qlora


@dataclass
class PeftConfig:
    """Which parameter-efficient method to use and its settings (`peft: none` = full FT); a run
    config's `cfg.peft` section, whose `method` is written `peft:` in YAML."""

    method: str = field(default="none", metadata={"flat": "peft"})  # none|lora|qlora|adapter
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "qkv_proj,o_proj"  # comma-separated names or globs
    qlora_block_size: int = 64
    adapter_bottleneck: int = 32
    adapter_targets: str = "mlp"


def targets(spec: str) -> list[str]:
    """The module names/globs of a comma-separated target spec."""
    return [t.strip() for t in spec.split(",") if t.strip()]


PEFT_METHODS = ("none", "lora", "qlora", "adapter")


def apply_peft(model: nn.Module, cfg: PeftConfig) -> list[str]:
    """Wrap `model` in place as cfg.peft says; returns the wrapped module names."""
    require_choice("peft", cfg.method, PEFT_METHODS)
    lora = (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, targets(cfg.lora_targets))
    if cfg.method == "lora":
        return apply_lora(model, *lora)
    if cfg.method == "qlora":
        return apply_qlora(model, *lora, block_size=cfg.qlora_block_size)
    if cfg.method == "adapter":
        return apply_adapters(model, targets(cfg.adapter_targets), cfg.adapter_bottleneck)
    return []
