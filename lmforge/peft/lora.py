"""LoRA: W = W0 + (α/r)·B·A on chosen nn.Linear layers, with merge/unmerge and adapter files.

``LoRALinear`` keeps the frozen base ``weight``/``bias`` under their original names, so a
LoRA-wrapped model still loads base checkpoints unchanged; the adapter lives in ``lora_A.weight``
[r, in] and ``lora_B.weight`` [out, r]. Adapter files follow PEFT: ``adapter_config.json`` and
``adapter_model.safetensors`` with keys ``base_model.model.<module>.lora_A.weight``. For a model
that came from a transformers family the modules are named as in that transformers model (a fused
``qkv_proj`` LoRA is written as q_proj/k_proj/v_proj, lmforge.interop.hf.lora_to_hf), so
``peft.PeftModel.from_pretrained`` puts the adapter on the original model; an lmforge-born model
keeps lmforge's module names. ``load_adapter`` reads both, and adapters HF PEFT trained.
"""

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge import fileio
from lmforge.errors import CheckpointError, ConfigError
from lmforge.interop.hf import lora_from_hf, lora_to_hf
from lmforge.model.config import ModelConfig
from lmforge.model.linear import Linear

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update: y = W0 x + b + (α/r)·B A dropout(x).

    A is kaiming-uniform (as in the paper and PEFT) and B is zero, so at init the output equals the
    base layer's. LoRA parameters are fp32 master weights whatever the base dtype.
    """

    def __init__(self, base: nn.Module, r: int = 8, alpha: float = 16, dropout: float = 0.0):
        super().__init__()
        if r <= 0 or alpha <= 0 or not 0 <= dropout < 1:
            got = f"r={r}, alpha={alpha}, dropout={dropout}"
            raise ConfigError(f"LoRA needs r > 0, alpha > 0 and 0 <= dropout < 1; got {got}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self._init_base(base)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        device = next(iter(base.state_dict().values())).device
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=device)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=device)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.disabled = False  # adapters_disabled: the base layer alone

    def _init_base(self, base: nn.Module) -> None:
        base.requires_grad_(False)
        self.weight, self.bias = base.weight, base.bias

    def base_forward(self, x: Tensor) -> Tensor:
        """The frozen layer alone (includes the update only while merged)."""
        return F.linear(x, self.weight, self.bias)

    def base_weight(self) -> Tensor:
        """W0 as a dense tensor (the merged weight while merged)."""
        return self.weight

    def delta_weight(self) -> Tensor:
        """(α/r)·B·A, the dense update this adapter adds to W0, shape [out, in]."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_forward(x)
        # merged: the update is already inside the weight; adding it again double counts
        if self.merged or self.disabled:
            return out
        h = self.lora_dropout(x).to(self.lora_A.weight.dtype)
        return out + (self.lora_B(self.lora_A(h)) * self.scaling).to(out.dtype)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold the update into W0 in place: faster inference, outputs unchanged. A weight tied to
        another module (lm_head and embedding) changes there too, so export with ``to_linear``."""
        if not self.merged:
            self.weight += self.delta_weight().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo ``merge`` (W0 back to within fp32 rounding), so training can go on."""
        if self.merged:
            self.weight -= self.delta_weight().to(self.weight.dtype)
            self.merged = False

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear holding W0 + ΔW (dtype of the base weight), for export."""
        base = self.base_weight()
        weight = base.float() if self.merged else base.float() + self.delta_weight().float()
        return dense_linear(weight.to(base.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, r={self.r}, alpha={self.alpha}"


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with every LoRA layer computing its frozen base layer alone for the body: the
    model before fine-tuning, with no copy of its weights (a DPO reference, as PEFT's
    `disable_adapter`). Merged layers cannot be switched off (LMForgeError)."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if any(m.merged for m in layers):
        raise ConfigError("adapters_disabled: unmerge the LoRA layers first")
    for m in layers:
        m.disabled = True
    try:
        yield model
    finally:
        for m in layers:
            m.disabled = False


@torch.no_grad()
def dense_linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """A plain `Linear` (model/linear.py) holding copies of ``weight`` [out, in] and ``bias``, on
    the weight's device and dtype (what an export writes in place of a LoRA or NF4 layer)."""
    out_features, in_features = weight.shape
    linear = Linear(in_features, out_features, bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)  # fmt: skip
    linear.weight.copy_(weight)
    if bias is not None:
        linear.bias.copy_(bias)
    return linear


def name_matches(name: str, patterns: str | Iterable[str]) -> bool:
    """True if a qualified module name matches a pattern (or one of them): PEFT-style (the whole
    name or a dotted suffix, so "q_proj" matches "blocks.0.attn.q_proj") or an fnmatch glob on
    the full name."""
    patterns = [patterns] if isinstance(patterns, str) else patterns
    return any(name == p or name.endswith("." + p) or fnmatchcase(name, p) for p in patterns)


def adaptable_linears(model: nn.Module) -> list[str]:
    """Qualified names of every nn.Linear in ``model`` (what ``targets`` can choose from), except
    the A/B matrices inside LoRA layers, which must never be wrapped or quantised themselves."""
    inside = tuple(n + "." for n in lora_modules(model))
    return [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not n.startswith(inside)
    ]


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every LoRA layer (including QLoRA ones) in ``model`` by qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def mark_only_lora_trainable(model: nn.Module) -> None:
    """Freeze everything, then unfreeze the LoRA A/B matrices."""
    model.requires_grad_(False)
    for m in lora_modules(model).values():
        m.lora_A.weight.requires_grad_(True)
        m.lora_B.weight.requires_grad_(True)


def apply_lora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    targets: str | Iterable[str] = ("q_proj", "v_proj"),
    wrap: Callable[[str, nn.Linear], LoRALinear] | None = None,
) -> list[str]:
    """Wrap each nn.Linear whose name matches ``targets`` (see ``name_matches``) in LoRALinear
    (or ``wrap(name, linear)``: QLoRA's) and freeze every other parameter. Returns the wrapped
    names; raises ConfigError, listing the candidates, if none matched."""
    names = [n for n in adaptable_linears(model) if name_matches(n, targets)]
    if not names:
        raise ConfigError(
            f"no nn.Linear matched targets {targets!r}; available: {adaptable_linears(model)}"
        )
    for n in names:
        linear = model.get_submodule(n)
        model.set_submodule(n, wrap(n, linear) if wrap else LoRALinear(linear, r, alpha, dropout))
    mark_only_lora_trainable(model)
    return names


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Only the adapter tensors (``...lora_A.weight`` / ``...lora_B.weight``), detached copies."""
    return {
        k: v.detach().clone().contiguous()
        for k, v in model.state_dict().items()
        if ".lora_A." in k or ".lora_B." in k
    }


def lora_config(model: nn.Module) -> dict:
    """The PEFT-style config describing the LoRA layers in ``model`` (exact module names)."""
    mods = lora_modules(model)
    if not mods:
        raise ConfigError("the model has no LoRA layers")
    ranks = {(m.r, m.alpha) for m in mods.values()}
    if len(ranks) > 1:
        raise ConfigError(f"LoRA layers disagree on (r, alpha): {sorted(ranks)}")
    (r, alpha), first = ranks.pop(), next(iter(mods.values()))
    drop = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": drop,
        "target_modules": sorted(mods),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": None,
    }


def save_adapter(
    model: nn.Module, directory: str | os.PathLike, config_dict: dict | None = None
) -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` (PEFT layout) atomically,
    under the transformers model's module names when the model came from one (module docstring).

    ``config_dict`` adds or overrides fields (e.g. ``base_model_name_or_path``) of ``lora_config``.
    """
    directory = Path(directory)
    cfg = lora_config(model)
    state = {k: v.cpu() for k, v in lora_state_dict(model).items()}
    config = getattr(model, "config", None)
    hf = lora_to_hf(config, state) if isinstance(config, ModelConfig) else None
    if hf is not None:
        state, cfg["target_modules"], extra = hf
        cfg.update(extra)
    cfg.update(config_dict or {})
    directory.mkdir(parents=True, exist_ok=True)
    fileio.remove_stale_temps(directory)  # temps of an earlier save that was killed
    # atomic writes: a killed save leaves no half-written adapter, only a temp found above
    fileio.save_tensors(directory / WEIGHTS_NAME, {PEFT_PREFIX + k: v for k, v in state.items()})
    fileio.write_json(directory / CONFIG_NAME, cfg)
    return directory


def read_adapter_config(directory: str | os.PathLike) -> dict:
    """Read and check an ``adapter_config.json``."""
    path = Path(directory) / CONFIG_NAME
    cfg = fileio.read_json(path, "adapter config")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{path}: peft_type {cfg['peft_type']!r} is not LORA")
    if missing := [k for k in ("r", "lora_alpha", "target_modules") if k not in cfg]:
        raise CheckpointError(f"{path}: missing fields {missing}")
    # PEFT options that change what the A/B matrices mean; reading past them would load wrongly
    options = ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern")
    if unsupported := [k for k in options if cfg.get(k)]:
        raise CheckpointError(f"{path}: {', '.join(unsupported)} not supported (plain LoRA only)")
    return cfg


def load_adapter(model: nn.Module, directory: str | os.PathLike) -> list[str]:
    """Apply LoRA as the saved config describes (unless the model already has LoRA layers, e.g. a
    QLoRA model) and load the saved A/B weights. Returns the LoRA module names.

    An adapter under transformers module names (ours for a model from a transformers family, or
    one HF PEFT trained) is mapped back onto lmforge's modules (lmforge.interop.hf.lora_from_hf)."""
    cfg = read_adapter_config(directory)
    path = Path(directory) / WEIGHTS_NAME
    saved = {k.removeprefix(PEFT_PREFIX): v for k, v in fileio.load_tensors(path).items()}
    config = getattr(model, "config", None)
    ours = lora_from_hf(config, saved, str(path)) if isinstance(config, ModelConfig) else None
    targets = cfg["target_modules"]
    if ours is not None:  # the module names are the file's, not target_modules' HF names
        saved = ours
        targets = sorted({k.removesuffix(".lora_A.weight") for k in saved if ".lora_A." in k})
    if not lora_modules(model):
        apply_lora(model, cfg["r"], cfg["lora_alpha"], cfg.get("lora_dropout", 0.0), targets)
    for n, m in lora_modules(model).items():
        if (m.r, m.alpha) != (cfg["r"], cfg["lora_alpha"]):
            raise CheckpointError(
                f"{directory}: {n} has r={m.r}, alpha={m.alpha} but the adapter was saved with "
                f"r={cfg['r']}, lora_alpha={cfg['lora_alpha']}"
            )
    lora = {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    copy_checked(lora, saved, path)
    return sorted(lora_modules(model))


@torch.no_grad()
def copy_checked(params: dict[str, Tensor], saved: dict[str, Tensor], where) -> None:
    """Copy saved adapter tensors into `params` (the adapter's parameters by name) after checking
    that names and shapes match exactly; a CheckpointError naming `where` otherwise."""
    missing, unexpected = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for k, v in saved.items():
        if v.shape != params[k].shape:
            raise CheckpointError(
                f"{where}: {k} has shape {tuple(v.shape)}, model expects {tuple(params[k].shape)}"
            )
        params[k].copy_(v)


def merge_lora(model: nn.Module, replace: bool = True) -> list[str]:
    """Merge every LoRA layer. ``replace=True`` swaps each for a plain nn.Linear holding W0 + ΔW
    (export; for QLoRA the base is dequantised); ``replace=False`` merges in place (undo with
    ``unmerge_lora``). Returns the merged names."""
    mods = lora_modules(model)
    for n, m in mods.items():
        if replace:
            model.set_submodule(n, m.to_linear())
        else:
            m.merge()
    return sorted(mods)


def unmerge_lora(model: nn.Module) -> list[str]:
    """Undo an in-place ``merge_lora(model, replace=False)``."""
    mods = lora_modules(model)
    for m in mods.values():
        m.unmerge()
    return sorted(mods)
