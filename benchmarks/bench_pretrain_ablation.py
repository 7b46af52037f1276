"""What each technique of configs/shakespeare-char-fast.yaml buys, on a tuning slice of the
TRAINING text (nanoGPT's validation split is never used here: settings are chosen on this).

The tuning slice: Tiny Shakespeare's first 90% (nanoGPT's training text) is the corpus, and its
last 10% is held out (`val_fraction: 0.1`), so the slice lies wholly inside nanoGPT's training
split. Each variant trains from configs/shakespeare-char.yaml (nanoGPT's recipe) with its
overrides, one thread, evaluating the held-out slice (504 blocks of 64 tokens) about 20 times per
run. The target is the loss the recipe itself ends at (its 2,000 steps) on the slice.

Steps to the target come from those runs (deterministic given the seed); the seconds per step
from a separate, alternating timing of every variant (training steps only, no evaluation) on
the same host, since the runs themselves overlap with other jobs.

    python benchmarks/bench_pretrain_ablation.py [--runs DIR] [--record]

A variant whose folder in DIR already holds final_metrics.json is not trained again.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from lmforge.data.corpus import shared_data_dir  # noqa: E402
from lmforge.train.config import TrainConfig, build_config  # noqa: E402
from lmforge.train.pretrain import Pretrainer  # noqa: E402

RECIPE = ROOT / "configs" / "shakespeare-char.yaml"
ARCH = {"model.pos": "rope", "model.mlp": "relu2", "model.qk_norm": True,
        "model.zero_init_proj": True}  # fmt: skip
WSD_B48 = {"batch_size": 48, "max_iters": 300, "lr": 3e-3, "min_lr": 1e-4, "schedule": "wsd",
           "cooldown_frac": 0.4, "warmup_iters": 30}  # fmt: skip
# name -> (what it adds, overrides of nanoGPT's recipe)
VARIANTS: dict[str, tuple[str, dict]] = {
    "nanogpt_recipe": ("nanoGPT's recipe: AdamW, batch 12, cosine, 2000 steps", {}),
    "adamw_b48_wsd": ("+ RoPE, QK-norm, ReLU^2, zero-init; batch 48, lr 3e-3, WSD, 300 steps",
                      {**ARCH, **WSD_B48}),
    "muon_b48_wsd": ("+ Muon (muon_lr 0.03) for the hidden matrices",
                     {**ARCH, **WSD_B48, "optimizer": "muon", "muon_lr": 0.03}),
    "muon_b48_wsd_gpt2_blocks": ("the same without RoPE, QK-norm, ReLU^2, zero-init (GPT-2 "
                                 "blocks: learned positions, GELU)",
                                 {**WSD_B48, "optimizer": "muon", "muon_lr": 0.03}),
}  # fmt: skip


def tuning_corpus(runs: Path) -> Path:
    """nanoGPT's training text (the first 90% of Tiny Shakespeare) as a file."""
    text = (shared_data_dir() / "tinyshakespeare.txt").read_text()
    path = runs / "train_text.txt"
    if not path.is_file():
        path.write_text(text[: int(len(text) * 0.9)])
    return path


def variant_config(name: str, runs: Path, **extra) -> TrainConfig:
    overrides = VARIANTS[name][1]
    steps = overrides.get("max_iters", 2000)
    base = {"data": str(tuning_corpus(runs)), "out_dir": str(runs / name), "progress": False,
            "samples": 0, "eval_iters": 504 // overrides.get("batch_size", 12),
            "eval_interval": max(1, steps // 20)}  # fmt: skip
    return build_config(TrainConfig, RECIPE, {**base, **overrides, **extra})


def train(name: str, runs: Path) -> None:
    if (runs / name / "final_metrics.json").is_file():
        return
    Pretrainer(variant_config(name, runs), log=lambda *_: None).run()


def val_curve(run: Path) -> list[tuple[int, float]]:
    with open(run / "metrics.csv") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"] == "val" and r["metric"] == "loss"]
    return [(int(r["step"]), float(r["value"])) for r in rows]


def step_seconds(names: list[str], runs: Path, rounds: int = 3, steps: int = 15) -> dict:
    """Median seconds per training step of each variant, the variants alternating."""
    trainers = {n: Pretrainer(variant_config(n, runs, out_dir=str(runs / f"timing_{n}")),
                              log=lambda *_: None) for n in names}  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            trainer.train_step()  # warm
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            times[name].append((time.perf_counter() - start) / steps)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="out/pretrain_ablation")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    for name in VARIANTS:
        train(name, runs)
    load_before = os.getloadavg()[0]
    seconds = step_seconds(list(VARIANTS), runs)
    target = val_curve(runs / "nanogpt_recipe")[-1][1]
    rows = []
    for name, (what, overrides) in VARIANTS.items():
        curve = val_curve(runs / name)
        hit = next((step for step, loss in curve if loss <= target), None)
        batch = overrides.get("batch_size", 12)
        to_target = hit * seconds[name] if hit else None
        rows.append([name, what, hit, hit and hit * batch * 64, round(1000 * seconds[name], 1),
                     to_target and round(to_target, 1), round(curve[-1][1], 4)])  # fmt: skip
        print(rows[-1])
    if args.record:
        from benchmarks.results import record

        final = json.loads((runs / "nanogpt_recipe" / "final_metrics.json").read_text())
        record(
            "pretrain_ablation",
            "Shakespeare-char: what each technique buys, on a tuning slice of the training text",
            [
                "variant",
                "adds",
                "steps to target",
                "tokens to target",
                "ms / step",
                "s to target (steps x ms/step)",
                "final loss",
            ],
            rows,
            notes=(
                f"Target: val loss {target:.4f} on the tuning slice (the last 10% of nanoGPT's "
                f"training text), what nanoGPT's recipe ends at after {final['step']} steps. "
                f"Evaluated about every 1/20 of each run (the first evaluation at or below the "
                f"target counts). ms / step: median of 3 alternating rounds of 15 training steps "
                f"per variant, one thread, on a host shared with other jobs (1-minute load "
                f"{load_before:.1f} at the start of the timing)."
            ),
        )


if __name__ == "__main__":
    main()
