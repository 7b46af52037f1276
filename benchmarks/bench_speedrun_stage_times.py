"""The cpu-tiny speedrun's stage times: the old plan (AdamW, GPT-2 blocks, 500 pretraining steps,
AdamW after it) against the preset (the fast pretraining settings in 300 steps, Muon in SFT, DPO
and GRPO), run at the same time on one machine, one thread each (`--deterministic`).

    python benchmarks/bench_speedrun_stage_times.py --runs DIR [--repeats 2] [--grpo-iters 30]
    python benchmarks/bench_speedrun_stage_times.py --runs DIR --record   # or --times JSON

GRPO is shortened to --grpo-iters steps (its steps cost the same throughout: sampling dominates,
the optimizer does not); the table's last column scales its time to the preset's step count, an
estimate of the whole run. RAG, the same in both plans, is left out. Both plans start every
repeat together, so the machine's load is the same for each; run it where at least
2 x repeats cores are free.
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

from benchmarks.bench_speedrun_pretrain import OLD_POST, OLD_PRETRAIN  # noqa: E402

STAGES = ["tokenizer", "pretrain", "sft", "reward", "dpo", "grpo", "eval"]
PLANS = {"old": {"pretrain": OLD_PRETRAIN, **OLD_POST}, "preset": {}}


def launch(runs: Path, repeats: int, grpo_iters: int) -> None:
    """Every plan x repeat at once, each a separate process with one thread."""
    procs = []
    for repeat in range(1, repeats + 1):
        for name, over in PLANS.items():
            config = runs / f"{name}.yaml"
            config.write_text(yaml.safe_dump({"stages": STAGES, **over}))
            out = runs / f"{name}{repeat}"
            cmd = [sys.executable, "-c", (
                "import sys; from lmforge.speedrun import Speedrun, resolve_plan; "
                "plan = resolve_plan('cpu-tiny', sys.argv[1], {'deterministic': True, "
                "'grpo.max_iters': int(sys.argv[3])}); "
                "Speedrun(plan, sys.argv[2], progress=False).run()"),
                str(config), str(out), str(grpo_iters)]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
            log = open(runs / f"{name}{repeat}.log", "w")  # noqa: SIM115 (the process's stdout)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    for proc in procs:
        proc.wait()


def stage_times(runs: Path) -> dict[str, dict[str, float]]:
    """{run: {stage: seconds}} from each finished stage's stage.json."""
    out = {}
    for run in sorted(p for p in runs.iterdir() if p.is_dir()):
        marks = {s: run / s / "stage.json" for s in STAGES}
        out[run.name] = {s: json.loads(m.read_text())["seconds"] for s, m in marks.items()
                         if m.is_file()}  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=Path, default=Path("out/speedrun_stage_times"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--grpo-iters", type=int, default=30)
    ap.add_argument("--record", action="store_true", help="record the runs in --runs")
    ap.add_argument("--note", default="", help="where and how it ran, for --record")
    ap.add_argument("--times", type=Path, default=None,
                    help="record a JSON {run: {stage: seconds}} made elsewhere")  # fmt: skip
    args = ap.parse_args()
    if not args.record and args.times is None:
        args.runs.mkdir(parents=True, exist_ok=True)
        launch(args.runs, args.repeats, args.grpo_iters)
    from lmforge.speedrun import resolve_plan

    full = resolve_plan("cpu-tiny")["grpo"]["max_iters"]
    rows = []
    measured = json.loads(args.times.read_text()) if args.times else stage_times(args.runs)
    for run, times in measured.items():
        total = sum(times.values())
        scaled = total + times.get("grpo", 0.0) * (full / args.grpo_iters - 1)
        rows.append([run, *(round(times.get(s, float("nan")), 1) for s in STAGES),
                     round(total, 1), round(scaled)])  # fmt: skip
        print(rows[-1])
    if args.record:
        from benchmarks.results import record

        record(
            "speedrun_stage_times",
            "Speedrun cpu-tiny stage seconds: the old plan vs the preset, side by side",
            ["run", *STAGES, "total s", f"total s, GRPO scaled to {full} steps (estimate)"],
            rows,
            notes=(
                "old: AdamW, GPT-2 blocks (learned positions, GELU), 500 pretraining steps, "
                "AdamW in SFT, DPO and GRPO. preset: Muon, RoPE, QK-norm, ReLU^2, zero-init, "
                "WSD, 300 pretraining steps, Muon for the hidden matrices in SFT (0.03), DPO "
                f"(0.006) and GRPO (0.003). GRPO ran {args.grpo_iters} steps in both. Every run "
                "one thread (--deterministic), all started together. " + args.note
            ),
        )


if __name__ == "__main__":
    main()
