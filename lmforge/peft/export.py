"""What a PEFT run saves and how a saved adapter is applied again.

A LoRA / QLoRA run saves the adapter alone (PEFT layout, `out_dir/adapter/`) and a merged model in
HF layout (`out_dir/`), so `lmforge generate --checkpoint out_dir` just works. A bottleneck adapter
cannot be merged (it is nonlinear): the adapter is saved alone in `out_dir/adapter/` next to the
unchanged base model, and `load_peft(lm.model, out_dir/adapter)` applies it.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn

from lmforge.fileio import load_tensors, read_json, save_tensors, write_json
from lmforge.lm import LM
from lmforge.peft.adapter import AdapterWrapper, apply_adapters
from lmforge.peft.config import PeftConfig, targets
from lmforge.peft.lora import copy_checked, dense_linear, load_adapter, merge_lora, save_adapter
from lmforge.peft.qlora import NF4Linear


def dense_copy(model: nn.Module) -> nn.Module:
    """A copy with LoRA merged and NF4 layers dequantised: a plain model for LM.save."""
    out = copy.deepcopy(model)
    merge_lora(out, replace=True)
    for name, m in list(out.named_modules()):
        if isinstance(m, NF4Linear):
            out.set_submodule(name, dense_linear(m.dequantized_weight().float(), m.bias))
    return out


def _unwrapped_copy(model: nn.Module) -> nn.Module:
    """A copy with bottleneck adapters removed (the base model they were added to)."""
    out = copy.deepcopy(model)
    for name, m in list(out.named_modules()):
        if isinstance(m, AdapterWrapper):
            out.set_submodule(name, m.module)
    return out


def export_peft(
    model: nn.Module, tokenizer, path: Path, cfg: PeftConfig | None, base: str | None = None
) -> None:
    """Save what users load: merged HF checkpoint, plus the adapter alone for PEFT runs (`cfg`
    None: the model as it is); `base` is the adapter's base_model_name_or_path."""
    path = Path(path)
    peft = cfg.method if cfg is not None else "none"
    if peft in ("lora", "qlora"):
        save_adapter(model, path / "adapter", {"base_model_name_or_path": base})
        LM(dense_copy(model), tokenizer).save(path)
    elif peft == "adapter":
        tensors = {n: p for n, p in model.named_parameters() if p.requires_grad}
        save_tensors(path / "adapter" / "adapter_model.safetensors", tensors)
        meta = {"peft_type": "BOTTLENECK", "targets": targets(cfg.adapter_targets),
                "bottleneck": cfg.adapter_bottleneck}  # fmt: skip
        write_json(path / "adapter" / "adapter_config.json", meta)
        LM(_unwrapped_copy(model), tokenizer).save(path)
    else:
        LM(model, tokenizer).save(path)


def load_peft(model: nn.Module, directory: str | Path) -> list[str]:
    """Apply a saved adapter directory (LoRA or bottleneck) to a base model, in place."""
    directory = Path(directory)
    meta = read_json(directory / "adapter_config.json", "adapter config")
    if meta.get("peft_type", "LORA") == "LORA":
        return load_adapter(model, directory)
    names = apply_adapters(model, meta["targets"], meta["bottleneck"])
    weights = directory / "adapter_model.safetensors"
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    copy_checked(trainable, load_tensors(weights), weights)
    return names
