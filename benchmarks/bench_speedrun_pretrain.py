"""The speedrun's cpu-tiny pretraining stage as it was (AdamW, GPT-2 blocks, 500 steps), against
the same stage with what configs/shakespeare-char-fast.yaml found (Muon, RoPE, QK-norm, ReLU^2,
zero-init, WSD) over fewer steps, the preset's pretraining since: val perplexity on the docs split
and training seconds.

Each variant runs `lmforge speedrun --preset cpu-tiny` with only the tokenizer and pretrain
stages, one thread, one after the other; nothing was tuned on the docs validation split (the
new settings are the ones chosen on Tiny Shakespeare's tuning slice; only the step count is
this benchmark's).

    python benchmarks/bench_speedrun_pretrain.py [--runs DIR] [--full] [--record]

--full also runs the whole cpu-tiny speedrun with the fast pretraining settings and the later
stages as the old preset had them (AdamW), and records its eval stage's table. --preset-run runs
(only) the whole speedrun as the preset has it now, one thread, and records its table.

A variant whose folder in DIR already holds a finished pretrain stage is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = {"stages": ["tokenizer", "pretrain"], "threads": 1}
# the cpu-tiny preset before it took the fast settings: its pretraining, and AdamW after it
OLD_PRETRAIN = {
    "model": {"pos": "learned", "mlp": "gelu", "qk_norm": False, "zero_init_proj": False},
    "optimizer": "adamw",
    "schedule": "cosine",
    "max_iters": 500,
    "eval_interval": 250,
}
OLD_POST = {stage: {"optimizer": "adamw"} for stage in ("sft", "dpo", "grpo")}
VARIANTS = {
    "cpu_tiny": ("the old preset: AdamW, cosine, 500 steps", OLD_PRETRAIN),
    "cpu_tiny_fast": (
        "Muon (muon_lr 0.03), RoPE, QK-norm, ReLU^2, zero-init, WSD (cooldown 0.4), 300 steps",
        {"model": {"pos": "rope", "mlp": "relu2", "qk_norm": True, "zero_init_proj": True},
         "optimizer": "muon", "muon_lr": 0.03, "schedule": "wsd", "cooldown_frac": 0.4,
         "max_iters": 300, "eval_interval": 150},
    ),
}  # fmt: skip

# the columns of the speedrun report's table, as both recorded runs give them
REPORT_COLUMNS = ["model after", "docs perplexity", "bits per byte", "exact match",
                  "reward (RM score)", "KL to SFT", "CORE"]  # fmt: skip


def run(name: str, runs: Path) -> dict:
    out = runs / name
    result = out / "pretrain" / "final_metrics.json"
    if not result.is_file():
        config = runs / f"{name}.yaml"
        config.write_text(yaml.safe_dump({**STAGES, "pretrain": VARIANTS[name][1]}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "lmforge.cli.main", "speedrun", "--preset", "cpu-tiny",
               "--config", str(config), "--out", str(out), "--no-progress"]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def full_run(runs: Path) -> dict:
    """The whole cpu-tiny speedrun with cpu_tiny_fast's pretraining: its eval stage's table."""
    out = runs / "full_fast"
    result = out / "eval" / "eval.json"
    if not result.is_file():
        config = runs / "full_fast.yaml"
        config.write_text(
            yaml.safe_dump({"threads": 1, "pretrain": VARIANTS["cpu_tiny_fast"][1], **OLD_POST})
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "lmforge.cli.main", "speedrun", "--preset", "cpu-tiny",
               "--config", str(config), "--out", str(out), "--no-progress"]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())


def preset_run(runs: Path) -> tuple[dict, dict[str, float]]:
    """The whole cpu-tiny speedrun as the preset has it, `--deterministic` (one thread): its eval
    stage's table and each stage's wall seconds."""
    out = runs / "preset"
    if not (out / "eval" / "eval.json").is_file():
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "lmforge.cli.main", "speedrun", "--preset", "cpu-tiny",
               "--deterministic", "--out", str(out), "--no-progress"]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    marks = sorted(out.glob("*/stage.json"), key=lambda m: m.stat().st_mtime)
    seconds = {m.parent.name: json.loads(m.read_text())["seconds"] for m in marks}
    return json.loads((out / "eval" / "eval.json").read_text()), seconds


def record_preset_run(runs: Path, note: str) -> None:
    from benchmarks.results import record

    table, seconds = preset_run(runs)
    rows = [[stage, round(m["perplexity"], 1), round(m["bpb"], 3), m["accuracy"],
             round(m["reward"], 3), round(m["kl"], 2), round(m.get("core", float("nan")), 3)]
            for stage, m in table.items()]  # fmt: skip
    for row in rows:
        print(row)
    walls = ", ".join(f"{stage} {s:.0f}" for stage, s in seconds.items())
    record(
        "speedrun_cpu_tiny",
        "Speedrun cpu-tiny as the preset has it (fast pretraining, Muon after it), one thread",
        REPORT_COLUMNS,
        rows,
        notes=(
            "One `lmforge speedrun --preset cpu-tiny --deterministic` run (one thread): the eval "
            "stage's table (exact match on 200 test problems, docs perplexity on 8,192 held-out "
            f"tokens). Stage wall seconds: {walls}. {note}"
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="out/speedrun_pretrain")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--record", action="store_true")
    parser.add_argument(
        "--preset-run",
        action="store_true",
        help="only the whole speedrun as the preset has it (recorded with --record)",
    )
    parser.add_argument("--note", default="", help="the host and its load, for --preset-run")
    args = parser.parse_args()
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    if args.preset_run:
        if args.record:
            record_preset_run(runs, args.note)
        else:
            print(preset_run(runs))
        return
    rows = []
    for name, (what, _) in VARIANTS.items():
        r = run(name, runs)
        rows.append([name, what, r["step"], round(r["val_loss"], 4), round(r["val_ppl"], 2),
                     round(r["elapsed_s"], 1), round(r["tokens_per_s"])])  # fmt: skip
        print(rows[-1])
    if args.record:
        from benchmarks.results import record

        record(
            "speedrun_pretrain",
            "Speedrun cpu-tiny pretraining stage: the preset vs the fast-recipe settings",
            ["variant", "settings", "steps", "val loss", "val ppl", "training s", "tokens/s"],
            rows,
            notes=(
                "Pretraining stage only (builtin:pydoc, BPE 2048, 4 layers x 128, batch 16 x 128 "
                "tokens), one thread, run one after the other on a 2-core host shared with other "
                "jobs. The host's load differed between the two runs (the fast variant's step does "
                "more work, Muon's Newton-Schulz, yet shows more tokens/s), so compare steps, not "
                "seconds. val: the stage's own evaluation (its first 20 x 16 validation blocks)."
            ),
        )
    if args.full:
        table = full_run(runs)
        rows = [[stage, round(m["perplexity"], 1), round(m["bpb"], 3), m["accuracy"],
                 round(m["reward"], 3), round(m["kl"], 2), round(m["core"], 3)]
                for stage, m in table.items()]  # fmt: skip
        for row in rows:
            print(row)
        if args.record:
            from benchmarks.results import record

            record(
                "speedrun_fast_pretrain_full",
                "Speedrun cpu-tiny with the fast pretraining, later stages as the old preset",
                REPORT_COLUMNS,
                rows,
                notes=(
                    "One run of the whole cpu-tiny speedrun, one thread, its pretraining stage "
                    "as cpu_tiny_fast (Muon, RoPE, QK-norm, ReLU^2, zero-init, WSD, 300 steps), "
                    "every later stage as the old preset had it (AdamW, tuned on the old "
                    "pretrained model). Compare with the old preset's table in docs/speedrun.md: "
                    "lower docs perplexity at every stage, lower exact match after SFT, DPO and "
                    "GRPO."
                ),
            )


if __name__ == "__main__":
    main()
