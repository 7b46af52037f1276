"""Run configs from YAML plus `--key value` overrides: `OptimConfig` (the optimizer, schedule and
loop settings: every run config's `cfg.optim`) and `TrainConfig` (a pretraining run).

A YAML file holds top-level training keys and a nested `model:` mapping (or a `preset:` name);
command-line overrides use the same names, dotted for the model (`--model.n_layer 6`).
Unknown keys fail with the list of valid ones; an old name (`steps`, `warmup`) names its new one.

A run config is composed of sections (`cfg.optim.lr`, `cfg.peft.lora_r`) besides its own fields:
in YAML, on the command line, in the saved config and as keyword arguments every field stays
flat (`lr: 1e-4`, `lora_r: 4`), each name belonging to one place (`run_config`, `flat_fields`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import ConfigError, check_field_types, require_choice, require_positive_ints
from lmforge.fileio import coerce_numbers, load_yaml
from lmforge.model.config import ModelConfig
from lmforge.train.optim import MUON_LR_ADJUST, OPTIMIZERS, SCHEDULES, cosine_lr, wsd_lr

# Names of earlier versions (and of other tools) for OptimConfig fields: one ConfigError line.
RENAMED = {"steps": "max_iters", "warmup": "warmup_iters"}


def require_fraction(cfg: object, name: str) -> None:
    """ConfigError unless the field `name` of `cfg` lies strictly between 0 and 1."""
    if not 0 < getattr(cfg, name) < 1:
        raise ConfigError(f"{name} must be in (0, 1), got {getattr(cfg, name)}")


def section(cls: type, **defaults: Any) -> Any:
    """A run config field holding one section of settings (`cfg.optim`) with this run's defaults
    (a subclass changes them: `@run_config(optim=dict(lr=1e-4))`). A section's field may give
    its flat name in metadata (`field(metadata={"flat": "peft"})`)."""
    meta = {"section": cls, "defaults": defaults}
    return field(default_factory=lambda: cls(**defaults), metadata=meta)


def flat_fields(cls: type) -> dict[str, tuple[str | None, str]]:
    """Each flat key a run config takes -> (its section or None for a top-level field, field)."""
    out: dict[str, tuple[str | None, str]] = {}
    for f in dataclasses.fields(cls):
        if kind := f.metadata.get("section"):
            out.update({g.metadata.get("flat", g.name): (f.name, g.name)
                        for g in dataclasses.fields(kind)})  # fmt: skip
        else:
            out[f.name] = (None, f.name)
    return out


def run_config(cls: type | None = None, /, **section_defaults: dict[str, Any]) -> Any:
    """`dataclass` for run configs. `@run_config(optim=dict(lr=1e-4))` changes the defaults of
    an inherited section; the constructor also takes the sections' fields flat, as YAML does:
    `DPOConfig(lora_r=4)` is `DPOConfig(peft=PeftConfig(lora_r=4, ...this run's defaults))`;
    `to_dict()` gives them flat (`flat_dict`)."""
    if cls is None:
        return lambda c: run_config(c, **section_defaults)
    own = dict(cls.__dict__.get("__annotations__", {}))
    for name, values in section_defaults.items():
        f = cls.__dataclass_fields__[name]  # the parent's section field
        own[name] = kind = f.metadata["section"]  # a class: no name to resolve in this module
        setattr(cls, name, section(kind, **{**f.metadata["defaults"], **values}))
    cls.__annotations__ = own
    cls = dataclass(cls)
    init, where = cls.__init__, flat_fields(cls)

    def __init__(self, **kwargs: Any) -> None:
        nested: dict[str, dict[str, Any]] = {}
        for key in [k for k in kwargs if where.get(k, (None,))[0] is not None]:
            if not dataclasses.is_dataclass(kwargs[key]):  # not a whole section (replace())
                name, fld = where[key]
                nested.setdefault(name, {})[fld] = kwargs.pop(key)
        for name, values in nested.items():
            base = kwargs.get(name) or cls.__dataclass_fields__[name].default_factory()
            kwargs[name] = dataclasses.replace(base, **values)
        init(self, **kwargs)

    cls.__init__, cls.to_dict = __init__, flat_dict
    return cls


def flat_dict(cfg: Any) -> dict[str, Any]:
    """A run config's settings as flat keys (what YAML takes; the run's saved config)."""
    fields = flat_fields(type(cfg)).items()
    return {k: getattr(getattr(cfg, s), f) if s else getattr(cfg, f) for k, (s, f) in fields}


@dataclass
class OptimConfig:
    """Every run config's `cfg.optim` (its fields are top-level keys of the run's YAML): the
    optimizer (AdamW, or Muon + AdamW) and its schedule (warmup + cosine, or warmup-stable-decay),
    the number of steps, clipping, accumulation, and when the loop logs, evaluates and saves. A
    run config sets its defaults (`section(OptimConfig, lr=...)`). lmforge/train/optim.py has the
    maths."""

    max_iters: int = 1000  # optimizer steps (RL: rollouts)
    optimizer: str = "adamw"  # adamw | muon (Muon for hidden matrices, AdamW at lr for the rest)
    lr: float = 1e-3
    min_lr: float = 1e-4
    schedule: str = "cosine"  # cosine | wsd (warmup, flat at lr, linear cooldown to min_lr)
    cooldown_frac: float = 0.2  # wsd: the last fraction of lr_decay_iters spent decaying
    warmup_iters: int = 0  # linear warmup steps (step 0 runs at lr / (warmup_iters + 1))
    lr_decay_iters: int | None = None  # the schedule reaches min_lr here; None = max_iters
    muon_lr: float = 0.02  # muon: the hidden matrices' peak lr (scheduled like lr)
    muon_momentum: float = 0.95  # muon: Nesterov momentum
    muon_weight_decay: float = 0.0  # muon: decoupled decay of the hidden matrices
    ns_steps: int = 5  # muon: Newton-Schulz iterations per update
    muon_lr_adjust: str = "original"  # muon: per-matrix lr factor (optim.MUON_LR_ADJUST)
    weight_decay: float = 0.0  # on matrices and embeddings only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping
    grad_accum: int = 1  # micro-batches whose gradients add up to one optimizer step
    eval_interval: int = 250
    log_interval: int = 10
    checkpoint_interval: int | None = None  # None = eval_interval
    progress: bool = True  # a bar on a terminal, plain lines in a log (lmforge/progress.py)

    def __post_init__(self) -> None:
        # None stays None (resolved where used), so dataclasses.replace(cfg, max_iters=...)
        # moves the end of the cosine and the checkpoint cadence along
        require_positive_ints(self, "max_iters", "grad_accum", "eval_interval", "log_interval")
        for name in ("lr_decay_iters", "checkpoint_interval"):
            if getattr(self, name) is not None:
                require_positive_ints(self, name)
        require_choice("optimizer", self.optimizer, OPTIMIZERS)
        require_choice("schedule", self.schedule, SCHEDULES)
        require_choice("muon_lr_adjust", self.muon_lr_adjust, MUON_LR_ADJUST)
        require_fraction(self, "cooldown_frac")
        require_positive_ints(self, "ns_steps")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        for name in ("lr", "muon_lr"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("min_lr", "warmup_iters", "grad_clip", "weight_decay", "muon_weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0 for the first); each param group runs
        at this times its `lr_scale` (Muon's matrices: muon_lr / lr)."""
        decay = self.lr_decay_iters or self.max_iters
        if self.schedule == "wsd":
            return wsd_lr(step, self.lr, self.min_lr, self.warmup_iters, decay, self.cooldown_frac)
        return cosine_lr(step, self.lr, self.min_lr, self.warmup_iters, decay)


@run_config
class SmallRunConfig:
    """What the small single-process trainers share (BERT pretraining, classification, seq2seq,
    the VLM): batch size, seed, torch threads, and AdamW as BERT trains (weight decay 0.01,
    beta2 0.999)."""

    optim: OptimConfig = section(OptimConfig, weight_decay=0.01, beta2=0.999)
    batch_size: int = 32
    seed: int = 0
    threads: int | None = None  # torch threads (None: torch's default; 1 suits a shared CPU)

    def __post_init__(self) -> None:
        require_positive_ints(self, "batch_size")


@run_config
class TrainConfig:
    """A pretraining run. Defaults: a tiny GPT on the built-in Python docs, a few CPU minutes.

    `batch_size` is the micro-batch of one forward pass and `grad_accum` the micro-batches of one
    optimizer step across all ranks (lmforge/train/parallel.py).
    """

    out_dir: str = "out/pretrain"
    data: str = "builtin:pydoc"  # file, folder, .jsonl, .parquet, builtin:NAME or hf:NAME
    text_field: str = "text"
    tokenizer: str = "bpe"  # bpe | char | word, or a path to a tokenizer.json / directory
    vocab_size: int = 2048  # for a tokenizer trained here
    val_fraction: float = 0.1
    preset: str | None = None
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields (override preset)
    batch_size: int = 12
    block_size: int = 64
    optim: OptimConfig = section(OptimConfig, max_iters=2000, warmup_iters=100, weight_decay=0.1)
    max_time: float | None = None  # seconds; stop early when reached (same-wall-time runs)
    # val losses whose first crossing is printed and saved (step, seconds since the run began)
    loss_milestones: list[float] = field(default_factory=list)
    target_loss: float | None = None  # stop at the first evaluation with val loss <= this
    label_smoothing: float = 0.0
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto (autocast; fp16 loss-scaled)
    compile: bool = False
    eval_iters: int = 20
    seed: int = 1337
    device: str = "auto"
    samples: int = 2  # samples printed at the end
    sample_tokens: int = 200
    sample_prompt: str = "\n"
    tensorboard: bool = False
    # scaling out (README "Scaling out"); `parallel` matters only under torchrun
    parallel: str = "ddp"  # ddp (replicas) | fsdp (FSDP2: sharded params/grads/optimizer)
    activation_checkpointing: bool = False  # recompute blocks in backward: less memory
    tokenize_workers: int = 1  # processes tokenizing the corpus into shards
    # the device's peak TFLOPS for the reported MFU; None: the bf16 peak of a known GPU
    # (lmforge.model.info.PEAK_BF16_TFLOPS), no MFU on other devices
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        require_positive_ints(self, "batch_size", "block_size")
        require_choice("dtype", self.dtype, ("float32", "bfloat16", "float16", "auto"))
        require_fraction(self, "val_fraction")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(f"peak_tflops must be > 0, got {self.peak_tflops}")
        milestones = {float(m) for m in self.loss_milestones}
        if self.target_loss is not None:
            milestones.add(float(self.target_loss))
        self.loss_milestones = sorted(milestones, reverse=True)

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The ModelConfig for this run: preset, then `model:` overrides, vocab from tokenizer."""
        overrides = {"vocab_size": vocab_size, "max_seq_len": self.block_size, **self.model}
        if self.preset:
            return ModelConfig.from_preset(self.preset, **overrides)
        return ModelConfig.from_dict(overrides, source="model")


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--key value` / `--key=value` pairs -> dict; values parsed as YAML scalars (1e-3, true)."""
    out: dict[str, Any] = {}
    rest = iter(args)
    for arg in rest:
        if not arg.startswith("--"):
            raise ConfigError(f"expected --key value, got {arg!r}")
        key, eq, raw = arg[2:].partition("=")
        if not eq and (raw := next(rest, None)) is None:  # --key value: the value is next
            raise ConfigError(f"missing value for {arg}")
        out[key.replace("-", "_")] = yaml.safe_load(raw) if raw != "" else ""
    return out


def build_config(cls, path: str | Path | None, overrides: dict[str, Any]):
    """Merge a YAML file and overrides into `cls` (a dataclass with a `model` dict field)."""
    data: dict[str, Any] = load_yaml(path) if path else {}
    source = str(path) if path else "command line"
    for key, value in overrides.items():
        if key.startswith("model."):
            data.setdefault("model", {})[key.removeprefix("model.")] = value
        else:
            data[key] = value
    where = flat_fields(cls)
    unknown = sorted(data.keys() - where.keys())
    for key in unknown:
        if RENAMED.get(key) in where:
            raise ConfigError(f"{source}: {key} is now called {RENAMED[key]}")
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(where))}"
        )
    if not isinstance(data.get("model", {}), dict):
        raise ConfigError(f"{source}: 'model' must be a mapping of ModelConfig fields")
    for owner in {name for name, _ in where.values()}:  # each section checks its fields
        kind = cls if owner is None else cls.__dataclass_fields__[owner].metadata["section"]
        mine = {where[k][1]: k for k in data if where[k][0] == owner}  # field -> flat key
        values = coerce_numbers(kind, {f: data[k] for f, k in mine.items()}, source)
        data.update({mine[f]: v for f, v in check_field_types(kind, values, source).items()})
    try:
        return cls(**data)
    except TypeError as err:
        raise ConfigError(f"{source}: {err}") from err
