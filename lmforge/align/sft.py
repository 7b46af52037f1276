"""Supervised fine-tuning: next-token loss on response tokens only, optionally packed, as full
fine-tuning or through a parameter-efficient method (LoRA, QLoRA, bottleneck adapters).

PEFT targets use lmforge's module names. Attention has ONE fused `qkv_proj` Linear (not separate
q/k/v), so LoRA's usual "q,v" becomes `qkv_proj` (it adapts queries, keys and values together);
the default `qkv_proj,o_proj` adds the output projection. MLP layers are `up_proj`, `down_proj`
(and `gate_proj` for GLU MLPs). Bottleneck adapters follow each block's `mlp` by default.

A LoRA / QLoRA run saves the adapter alone (PEFT layout, `out_dir/adapter/`) and a merged model in
HF layout (`out_dir/`), so `lmforge generate --checkpoint out_dir` just works. A bottleneck adapter
cannot be merged (it is nonlinear): the adapter is saved alone in `out_dir/adapter/` next to the
unchanged base model, and `load_peft(lm.model, out_dir/adapter)` applies it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from lmforge.align import data as D
from lmforge.align.losses import sft_loss
from lmforge.align.peft import (
    AdapterWrapper,
    NF4Linear,
    apply_adapters,
    apply_lora,
    apply_qlora,
    merge_lora,
    save_adapter,
)
from lmforge.align.tasks import verify
from lmforge.align.trainer import AlignConfig, AlignTrainer
from lmforge.errors import CheckpointError, ConfigError
from lmforge.fileio import load_tensors, read_json, save_tensors, write_json
from lmforge.lm import LM


@dataclass
class PeftConfig:
    """Which parameter-efficient method to use and its settings (`peft: none` = full FT)."""

    peft: str = "none"  # none | lora | qlora | adapter
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "qkv_proj,o_proj"  # comma-separated names or globs
    qlora_block_size: int = 64
    adapter_bottleneck: int = 32
    adapter_targets: str = "mlp"


@dataclass
class SFTConfig(PeftConfig, AlignConfig):
    """An SFT run (`lmforge sft`; `lmforge lora` sets peft)."""

    out_dir: str = "out/sft"
    packing: bool = False
    label_smoothing: float = 0.0
    eval_generate: int = 100  # held-out task prompts scored by greedy exact match (0 = off)
    max_new_tokens: int = 16


def _targets(spec: str) -> list[str]:
    return [t.strip() for t in spec.split(",") if t.strip()]


PEFT_METHODS: dict[str, Callable[[nn.Module, PeftConfig], list[str]]] = {
    "none": lambda model, cfg: [],
    "lora": lambda model, cfg: apply_lora(
        model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, _targets(cfg.lora_targets)
    ),
    "qlora": lambda model, cfg: apply_qlora(
        model,
        cfg.lora_r,
        cfg.lora_alpha,
        cfg.lora_dropout,
        _targets(cfg.lora_targets),
        block_size=cfg.qlora_block_size,
    ),  # fmt: skip
    "adapter": lambda model, cfg: apply_adapters(
        model, _targets(cfg.adapter_targets), cfg.adapter_bottleneck
    ),
}


def apply_peft(model: nn.Module, cfg: PeftConfig) -> list[str]:
    """Wrap `model` in place as cfg.peft says; returns the wrapped module names."""
    if cfg.peft not in PEFT_METHODS:
        raise ConfigError(f"peft must be one of {', '.join(PEFT_METHODS)}, got {cfg.peft!r}")
    return PEFT_METHODS[cfg.peft](model, cfg)


def dense_copy(model: nn.Module) -> nn.Module:
    """A copy with LoRA merged and NF4 layers dequantised: a plain model for LM.save."""
    out = copy.deepcopy(model)
    merge_lora(out, replace=True)
    for name, m in list(out.named_modules()):
        if isinstance(m, NF4Linear):
            linear = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(m.dequantized_weight())
                if m.bias is not None:
                    linear.bias.copy_(m.bias)
            out.set_submodule(name, linear)
    return out


def _unwrapped_copy(model: nn.Module) -> nn.Module:
    """A copy with bottleneck adapters removed (the base model they were added to)."""
    out = copy.deepcopy(model)
    for name, m in list(out.named_modules()):
        if isinstance(m, AdapterWrapper):
            out.set_submodule(name, m.module)
    return out


def export_peft(model: nn.Module, tokenizer, path: Path, cfg: PeftConfig) -> None:
    """Save what users load: merged HF checkpoint, plus the adapter alone for PEFT runs."""
    path = Path(path)
    if cfg.peft in ("lora", "qlora"):
        save_adapter(
            model, path / "adapter", {"base_model_name_or_path": getattr(cfg, "init", None)}
        )
        LM(dense_copy(model), tokenizer).save(path)
    elif cfg.peft == "adapter":
        tensors = {n: p for n, p in model.named_parameters() if p.requires_grad}
        save_tensors(path / "adapter" / "adapter_model.safetensors", tensors)
        meta = {"peft_type": "BOTTLENECK", "targets": _targets(cfg.adapter_targets),
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
        from lmforge.align.lora import load_adapter

        return load_adapter(model, directory)
    names = apply_adapters(model, meta["targets"], meta["bottleneck"])
    saved = load_tensors(directory / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    if set(saved) - set(params):
        raise CheckpointError(f"{directory}: adapter tensors do not match this model")
    with torch.no_grad():
        for k, v in saved.items():
            params[k].copy_(v)
    return names


@torch.no_grad()
def exact_match(
    lm: LM, records: list[dict], max_new_tokens: int = 16, add_bos: bool = False, batch: int = 128
) -> float:
    """Fraction of records whose greedy completion passes `tasks.verify`."""
    if not records:
        return 0.0
    tok = lm.tokenizer
    hits = 0.0
    for i in range(0, len(records), batch):
        chunk = records[i : i + batch]
        prompts = [D.prompt_ids(r, tok, add_bos) for r in chunk]
        outs = lm.generate(prompts, max_new_tokens=max_new_tokens, temperature=0.0)
        for r, ids in zip(chunk, outs):
            hits += verify(r, tok.decode(ids, skip_special_tokens=True))
    return hits / len(records)


def eval_source(cfg: AlignConfig) -> tuple[str | None, str]:
    """(source, split) of the evaluation data: eval_data, else the held-out split of a task."""
    if cfg.eval_data:
        return cfg.eval_data, "all"
    if str(cfg.data).startswith("task:"):
        return cfg.data, "test"
    return None, "train"


def split_dataset(train: D.Dataset, cfg: AlignConfig, loader) -> tuple[list, list]:
    """(train examples, eval examples): a separate eval source, or the last 5% of the data."""
    source, split = eval_source(cfg)
    if source is not None:
        kw = {"n": cfg.n_eval, "seed": cfg.seed + 1, "split": split}
        ev = loader(source, skip_invalid=cfg.skip_invalid, **kw)
        return train.examples, ev.examples
    n_eval = max(1, len(train.examples) // 20)
    if len(train.examples) < 2:
        raise ConfigError("need at least 2 examples to hold some out for evaluation")
    return train.examples[:-n_eval], train.examples[-n_eval:]


class SFTTrainer(AlignTrainer):
    """Response-only next-token training (full or PEFT) with held-out loss and exact match."""

    name = "sft"
    curves = [("train", "loss"), ("eval", "loss"), ("eval", "exact_match")]

    def setup(self) -> None:
        cfg: SFTConfig = self.cfg
        if cfg.max_len > self.lm.config.max_seq_len:
            raise ConfigError(
                f"max_len={cfg.max_len} exceeds max_seq_len={self.lm.config.max_seq_len}"
            )
        loader = lambda src, **kw: D.load_sft(
            src, self.tokenizer, cfg.max_len, add_bos=cfg.add_bos, **kw
        )
        train = loader(cfg.data, skip_invalid=cfg.skip_invalid, n=cfg.n_train, seed=cfg.seed)
        if train.skipped:
            self.log(f"skipped {train.skipped} invalid records (first: {train.reasons[0]})")
        self.train_examples, self.eval_examples = split_dataset(train, cfg, loader)
        if cfg.packing:
            self.train_examples = D.pack_sft(self.train_examples, cfg.max_len)
        source, split = eval_source(cfg)
        self.eval_records = []
        if cfg.eval_generate > 0 and source is not None and str(source).startswith("task:"):
            self.eval_records = D.load_prompts(source, cfg.eval_generate, cfg.seed + 1, split)
        self.peft_names = apply_peft(self.lm.model, cfg)

    def num_examples(self) -> int:
        return len(self.train_examples)

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        rows = [self.train_examples[i] for i in indices]
        return {k: v.to(self.device) for k, v in D.collate_sft(rows, self.pad_id).items()}

    def loss(self, batch):
        # Right padding: causal attention never lets a real token see the padding after it,
        # so no attention mask is needed (and SDPA keeps its fast causal path).
        logits = self.lm.model(batch["input_ids"])
        loss = sft_loss(logits, batch["labels"], label_smoothing=self.cfg.label_smoothing)
        return loss, {}

    def loss_weight(self, batch) -> float:
        """Response tokens: the loss is a mean over them (see AlignTrainer.loss_weight)."""
        return float((batch["labels"][:, 1:] != D.IGNORE).sum())

    def eval_loss(self, examples: list[D.SFTExample]) -> float:
        """Mean response-token loss over examples (token-weighted)."""
        total, count = 0.0, 0
        for i in range(0, len(examples), self.cfg.batch_size):
            b = D.collate_sft(examples[i : i + self.cfg.batch_size], self.pad_id)
            n = int((b["labels"][:, 1:] != D.IGNORE).sum())
            logits = self.lm.model(b["input_ids"].to(self.device))
            total += sft_loss(logits, b["labels"].to(self.device)).item() * n
            count += n
        return total / max(1, count)

    def evaluate(self) -> dict[str, float]:
        result = {"loss": self.eval_loss(self.eval_examples)}
        if self.eval_records:
            result["exact_match"] = exact_match(
                self.lm, self.eval_records, self.cfg.max_new_tokens, self.cfg.add_bos
            )
        return result

    def export(self, path: Path) -> None:
        export_peft(self.lm.model, self.tokenizer, path, self.cfg)
