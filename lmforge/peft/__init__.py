"""Parameter-efficient fine-tuning: LoRA (``lora``), QLoRA with an NF4 base (``qlora``),
bottleneck adapters (``adapter``), the run settings and ``apply_peft`` (``config``), and what a
run saves / how a saved adapter is applied (``export``).

The layer-level API is re-exported here; ``config`` and ``export`` are imported from their modules
(``export`` builds on ``lmforge.lm``).
"""

from lmforge.peft.adapter import Adapter, AdapterWrapper, apply_adapters
from lmforge.peft.lora import (
    LoRALinear,
    apply_lora,
    load_adapter,
    lora_config,
    lora_modules,
    lora_state_dict,
    merge_lora,
    save_adapter,
    unmerge_lora,
)
from lmforge.peft.qlora import (
    NF4Linear,
    QLoRALinear,
    apply_qlora,
    dequantize_nf4,
    nf4_code,
    quantize_nf4,
)

__all__ = [
    "Adapter",
    "AdapterWrapper",
    "LoRALinear",
    "NF4Linear",
    "QLoRALinear",
    "apply_adapters",
    "apply_lora",
    "apply_qlora",
    "dequantize_nf4",
    "load_adapter",
    "lora_config",
    "lora_modules",
    "lora_state_dict",
    "merge_lora",
    "nf4_code",
    "quantize_nf4",
    "save_adapter",
    "unmerge_lora",
]
