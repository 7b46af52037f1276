"""Which of the fast pretraining settings the cpu-tiny speedrun can take without losing the later
stages' exact match: pretraining variants x SFT settings, then DPO and GRPO from the best SFT
setting of each variant, every model scored on VALIDATION data only.

    python benchmarks/speedrun_transfer.py --runs DIR [--workers N] [--deadline S] [--record]

Why the later stages need other settings after Muon: Muon's orthogonalised updates leave the
hidden matrices with several times the RMS of AdamW-trained ones, so AdamW at the preset's
post-training learning rates moves them several times less, relative to their size. The SFT
candidates therefore scale the post-training step (AdamW's lr, or Muon for the hidden matrices
as in pretraining); each carries the DPO and GRPO settings scaled by the same factor.

Every job is one `Speedrun` (the cpu-tiny plan plus the job's overrides) in its own folder, one
thread, `--workers` at a time; a SFT job starts from a copy of its pretraining variant's
finished folder, and a downstream job continues its SFT job's folder with DPO and GRPO (no reward
model, eval or RAG). Scores, on data the speedrun's report never shows:

  val em    greedy exact match on N_VAL problems of the task's validation split (the report's
            exact match is on the test split)
  val ppl   docs perplexity on the pretraining validation shard AFTER the tokens the report's
            eval stage scores (val.bin[ppl_tokens:])

For each pretraining variant named in DOWNSTREAM, the SFT candidate with the highest mean val em
over its seeds goes on to DPO and GRPO, with every seed. DIR/summary.json holds every finished
job (rewritten after each); jobs still running at --deadline are stopped and left out.
`--record` renders DIR/summary.json into docs/benchmarks.md (`speedrun_transfer`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_speedrun_pretrain import VARIANTS  # noqa: E402

N_VAL = 500
FAST = VARIANTS["cpu_tiny_fast"][1]
PRESET_ARCH = {"pos": "learned", "mlp": "gelu", "qk_norm": False, "zero_init_proj": False}

# pretraining variant -> (what, the plan's pretrain section); "preset" and "fast" are
# bench_speedrun_pretrain.py's, so their finished folders can be reused (--reuse)
PRETRAIN: dict[str, tuple[str, dict[str, Any]]] = {
    "preset": ("the old preset: AdamW, cosine, 500 steps", VARIANTS["cpu_tiny"][1]),
    "fast": ("Muon, RoPE, QK-norm, ReLU^2, zero-init, WSD, 300 steps", FAST),
    "muon_wsd": ("Muon + WSD, 300 steps, the preset's blocks (learned positions, GELU)",
                 {**FAST, "model": PRESET_ARCH}),
    "fast_wd": ("fast + Muon weight decay 0.1", {**FAST, "muon_weight_decay": 0.1}),
    "fast_adamw": ("fast blocks, AdamW lr 3e-3 + WSD, 300 steps",
                   {**{k: v for k, v in FAST.items() if k != "muon_lr"}, "optimizer": "adamw",
                    "lr": 3.0e-3, "min_lr": 3.0e-4}),
}  # fmt: skip


def _scaled(factor: float) -> dict[str, dict[str, Any]]:
    """The preset's SFT, DPO and GRPO learning rates times `factor` (AdamW)."""
    return {
        "sft": {"optimizer": "adamw", "lr": 1.0e-3 * factor, "min_lr": 1.0e-4 * factor},
        "dpo": {"optimizer": "adamw", "lr": 2.0e-4 * factor},
        "grpo": {"optimizer": "adamw", "lr": 1.0e-4 * factor, "min_lr": 1.0e-4 * factor},
    }


def _muon(muon_lr: float) -> dict[str, dict[str, Any]]:
    """Muon for the hidden matrices in SFT at muon_lr (the rest AdamW at the preset's lr); DPO
    and GRPO with Muon at the same ratio to their AdamW lr."""
    return {"sft": {"optimizer": "muon", "muon_lr": muon_lr},
            "dpo": {"optimizer": "muon", "muon_lr": muon_lr * 0.2},
            "grpo": {"optimizer": "muon", "muon_lr": muon_lr * 0.1}}  # fmt: skip


# post-training candidate -> (what, {stage: overrides}) for sft, dpo and grpo
POST: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "adamw_x1": ("AdamW at the preset's lr (SFT 1e-3, DPO 2e-4, GRPO 1e-4)", _scaled(1.0)),
    "adamw_x3": ("AdamW at 3x the preset's lr", _scaled(3.0)),
    "muon_0.01": ("Muon 0.01 for the hidden matrices (DPO 0.002, GRPO 0.001)", _muon(0.01)),
    "muon_0.03": ("Muon 0.03 for the hidden matrices (DPO 0.006, GRPO 0.003)", _muon(0.03)),
}
SEEDS = (1337, 1338)  # the trainers' seed (1337 is the preset's)
# (pretraining variant, post-training candidates, seeds), in the order they are queued
SFT_GRID: list[tuple[str, tuple[str, ...], tuple[int, ...]]] = [
    ("preset", ("adamw_x1",), SEEDS),
    ("preset", ("muon_0.01",), SEEDS[:1]),
    ("fast", tuple(POST), SEEDS),
    ("muon_wsd", tuple(POST), SEEDS),
    ("fast_wd", tuple(POST), SEEDS[:1]),
    ("fast_adamw", tuple(POST), SEEDS[:1]),
]
DOWNSTREAM = ("preset", "fast", "muon_wsd")  # variants whose best SFT goes on to DPO and GRPO


# --smoke: every stage a few steps (to check the script, not to measure anything)
SMOKE = {"pretrain": {"max_iters": 4, "eval_interval": 2, "eval_iters": 1},
         "sft": {"max_iters": 4, "eval_interval": 2, "n_eval": 8, "eval_generate": 8},
         "dpo": {"max_iters": 2, "eval_interval": 2, "n_eval": 8},
         "grpo": {"max_iters": 2, "eval_interval": 2, "n_eval": 8, "batch_size": 8}}  # fmt: skip
smoke = False


def plan_config(pretrain: str, post: str | None, seed: int, stages: list[str]) -> dict:
    """The YAML (over the cpu-tiny preset) of one job."""
    cfg: dict[str, Any] = {"threads": 1, "stages": stages, "pretrain": PRETRAIN[pretrain][1]}
    if post is not None:
        for stage, over in POST[post][1].items():
            if stage in stages:
                cfg[stage] = {**over, **({"seed": seed} if seed != SEEDS[0] else {})}
    if smoke:
        cfg = {**cfg, **{s: {**cfg.get(s, {}), **SMOKE[s]} for s in stages if s in SMOKE}}
    return cfg


def scores_file(spec: dict) -> Path:
    """Where a job leaves its scores (SFT and downstream jobs share a folder)."""
    return Path(spec["out"]) / f"scores_{'_'.join(spec['score'])}.json"


# ----------------------------------------------------------------------------- one job


def run_job(spec_path: Path) -> None:
    """Run one job's speedrun in this process, then score its new models on validation data."""
    import torch

    from lmforge.speedrun import Speedrun, resolve_plan

    torch.set_num_threads(1)
    spec = json.loads(spec_path.read_text())
    out = Path(spec["out"])
    config = out.parent / f"{out.name}.yaml"
    config.write_text(yaml.safe_dump(spec["config"]))
    plan = resolve_plan("cpu-tiny", config)
    t0 = time.perf_counter()
    results = Speedrun(plan, out, log=lambda *a: None, progress=False).run()
    scores = {
        stage: {"seconds": results[stage]["seconds"], **score(out / stage, out, plan)}
        for stage in spec["score"]
    }
    scores_file(spec).write_text(
        json.dumps({"wall_s": time.perf_counter() - t0, "stages": scores}, indent=1)
    )


def score(model_dir: Path, run: Path, plan: dict) -> dict[str, float]:
    import numpy as np

    from lmforge.align.data import load_prompts
    from lmforge.align.sft import greedy_accuracy
    from lmforge.data.shards import TokenShard
    from lmforge.eval.perplexity import perplexity
    from lmforge.lm import LM

    records = load_prompts(f"task:{plan['task']}:chat", N_VAL, seed=2024, split="validation")
    lm = LM.load(model_dir)
    lm.model.eval()
    shard = TokenShard.open(run / "pretrain" / "data" / "val.bin")
    ids = np.asarray(shard.tokens[plan["eval"]["ppl_tokens"] :])
    ppl = perplexity(lm.model, ids.tolist(), lm.tokenizer.token_byte_lengths())
    return {"val_ppl": ppl.perplexity, "val_em": greedy_accuracy(lm, records, 6)}


# ----------------------------------------------------------------------------- scheduler


class Grid:
    """Queue, start and collect jobs, `workers` at a time, until all are done or the deadline."""

    def __init__(self, runs: Path, workers: int, deadline: float, reuse: Path | None):
        self.runs, self.workers, self.deadline, self.reuse = runs, workers, deadline, reuse
        self.queue: list[tuple[int, str, dict]] = []  # (priority, name, spec); 0 runs first
        self.running: dict[str, tuple[subprocess.Popen, dict, float]] = {}
        self.done: dict[str, dict] = {}
        self.start = time.time()

    def add(self, priority: int, name: str, spec: dict) -> None:
        self.queue.append((priority, name, spec))
        self.queue.sort(key=lambda item: item[0])

    def launch(self, name: str, spec: dict) -> None:
        if scores_file(spec).is_file():  # finished in an earlier call
            self.finish(name, spec, json.loads(scores_file(spec).read_text()))
            return
        spec_path = self.runs / f"{name}.job.json"
        spec_path.write_text(json.dumps(spec))
        log = open(self.runs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cmd = [sys.executable, str(Path(__file__).resolve()), "--job", str(spec_path)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.running[name] = (proc, spec, time.time())

    def finish(self, name: str, spec: dict, scores: dict) -> None:
        self.done[name] = {**spec["meta"], **scores}
        print(f"[{time.time() - self.start:5.0f} s] {name}: {json.dumps(scores['stages'])}")
        self.on_done(name, spec)

    def on_done(self, name: str, spec: dict) -> None:
        meta = spec["meta"]
        if meta["kind"] == "pretrain":
            for variant, posts, seeds in SFT_GRID:
                if variant == meta["pretrain"]:
                    for post in posts:
                        for seed in seeds:
                            self.add_sft(variant, post, seed)
        elif meta["kind"] == "sft" and meta["pretrain"] in DOWNSTREAM:
            self.maybe_downstream(meta["pretrain"])

    def add_sft(self, variant: str, post: str, seed: int) -> None:
        out = self.runs / f"{variant}--{post}--{seed}"
        if not out.exists():
            shutil.copytree(self.runs / variant, out, ignore=shutil.ignore_patterns(
                "training_state*", "state", "*.png", "report*", "readme_tables.md"))  # fmt: skip
        stages = ["tokenizer", "pretrain", "sft"]
        priority = 1 if variant in DOWNSTREAM else 2
        self.add(priority, out.name, {
            "out": str(out), "config": plan_config(variant, post, seed, stages), "score": ["sft"],
            "meta": {"kind": "sft", "pretrain": variant, "post": post, "seed": seed}})  # fmt: skip

    def maybe_downstream(self, variant: str) -> None:
        wanted = [(p, s) for v, posts, seeds in SFT_GRID if v == variant for p in posts
                  for s in seeds]  # fmt: skip
        sft = {(d["post"], d["seed"]): d["stages"]["sft"]["val_em"] for d in self.done.values()
               if d["kind"] == "sft" and d["pretrain"] == variant}  # fmt: skip
        if len(sft) < len(wanted):
            return
        posts = {p for p, _ in wanted}
        best = max(sorted(posts), key=lambda p: mean(v for (q, _), v in sft.items() if q == p))
        for post, seed in wanted:
            if post != best:
                continue
            out = self.runs / f"{variant}--{post}--{seed}"
            stages = ["tokenizer", "pretrain", "sft", "dpo", "grpo"]
            meta = {"kind": "downstream", "pretrain": variant, "post": post, "seed": seed}
            self.add(0, f"{out.name}--down", {
                "out": str(out), "config": plan_config(variant, post, seed, stages),
                "score": ["dpo", "grpo"], "meta": meta})  # fmt: skip

    def run(self) -> None:
        for variant in dict.fromkeys(v for v, _, _ in SFT_GRID):
            out = self.runs / variant
            src = self.reuse / variant if self.reuse else None
            if src is not None and (src / "pretrain" / "stage.json").is_file() and not out.exists():
                shutil.copytree(src, out, ignore=shutil.ignore_patterns("training_state*"))
            spec = {"out": str(out), "score": ["pretrain"],
                    "config": plan_config(variant, None, SEEDS[0], ["tokenizer", "pretrain"]),
                    "meta": {"kind": "pretrain", "pretrain": variant}}  # fmt: skip
            self.add(0, variant, spec)
        while (self.queue or self.running) and time.time() - self.start < self.deadline:
            for name, (proc, spec, _) in list(self.running.items()):
                if proc.poll() is None:
                    continue
                del self.running[name]
                result = scores_file(spec)
                if proc.returncode == 0 and result.is_file():
                    self.finish(name, spec, json.loads(result.read_text()))
                else:
                    print(f"{name}: failed (rc {proc.returncode}), see {self.runs}/{name}.log")
            while self.queue and len(self.running) < self.workers:
                _, name, spec = self.queue.pop(0)
                self.launch(name, spec)
            self.write()
            time.sleep(1)
        for name, (proc, _, _) in self.running.items():
            print(f"{name}: stopped at the deadline")
            proc.kill()
        self.write()

    def write(self) -> None:
        summary = {"machine": {"cpu": cpu_name(),
                               "cores": os.cpu_count(), "workers": self.workers},
                   "command": "python " + " ".join(sys.argv), "n_val": N_VAL,
                   "jobs": self.done}  # fmt: skip
        (self.runs / "summary.json").write_text(json.dumps(summary, indent=1))


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(
            line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- report


def table(summary: dict) -> list[list]:
    """One row per (pretraining variant, post-training candidate): means over the seeds run."""
    groups: dict[tuple[str, str], dict[str, list[float]]] = {}
    pre: dict[str, dict] = {}
    for job in summary["jobs"].values():
        if job["kind"] == "pretrain":
            pre[job["pretrain"]] = job["stages"]["pretrain"]
            continue
        g = groups.setdefault((job["pretrain"], job["post"]), {})
        for stage, s in job["stages"].items():
            g.setdefault(f"{stage}_em", []).append(s["val_em"])
            g.setdefault(f"{stage}_ppl", []).append(s["val_ppl"])
    rows = []
    for (variant, post), g in sorted(groups.items(), key=lambda kv: list(PRETRAIN).index(kv[0][0])):
        cell = {k: round(mean(v), 3) for k, v in g.items()}
        rows.append([variant, round(pre.get(variant, {}).get("val_ppl", float("nan")), 1), post,
                     len(g["sft_em"]), cell["sft_em"], cell.get("dpo_em", ""),
                     cell.get("grpo_em", ""), cell["sft_ppl"]])  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=Path, default=Path("out/speedrun_transfer"))
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds; stop what still runs")
    ap.add_argument("--reuse", type=Path, default=None,
                    help="a folder of finished pretraining variants (bench_speedrun_pretrain's "
                         "cpu_tiny / cpu_tiny_fast are named preset / fast here)")  # fmt: skip
    ap.add_argument("--job", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="a few steps a stage: checks the script")
    ap.add_argument("--record", action="store_true")
    args = ap.parse_args()
    if args.job is not None:
        run_job(args.job)
        return
    global smoke
    smoke = args.smoke
    if not args.record:
        args.runs.mkdir(parents=True, exist_ok=True)
        Grid(args.runs.resolve(), args.workers, args.deadline, args.reuse).run()
    summary = json.loads((args.runs / "summary.json").read_text())
    rows = table(summary)
    for row in rows:
        print(row)
    if args.record:
        from benchmarks.results import record

        record(
            "speedrun_transfer",
            "Speedrun cpu-tiny: pretraining variants x post-training settings, on validation",
            [
                "pretraining",
                "pretrain val ppl",
                "post-training",
                "seeds",
                "SFT val em",
                "DPO val em",
                "GRPO val em",
                "SFT val docs ppl",
            ],
            rows,
            command=f"{summary['command']} (then --record here)" if "command" in summary else None,
            notes=(
                f"Validation only: greedy exact match on {summary['n_val']} problems of the "
                "task's validation split, docs perplexity on val.bin after the tokens the "
                "report scores; means over the seeds run (trainer seed 1337, 1338). Pretraining "
                "variants: " + "; ".join(f"{k}: {v[0]}" for k, v in PRETRAIN.items()) + ". "
                "Post-training: " + "; ".join(f"{k}: {v[0]}" for k, v in POST.items()) + ". "
                "DPO and GRPO ran from the best SFT candidate (mean SFT val em) of preset, fast "
                "and muon_wsd (blank: not run). Ran on a "
                f"{summary['machine']['cores']}-core {summary['machine']['cpu']}, one thread a "
                f"job, {summary['machine']['workers']} jobs at a time (`--workers`; the machine "
                "above is where the table was recorded); the preset and fast pretraining folders "
                "were bench_speedrun_pretrain.py's (`--reuse`)."
            ),
        )


if __name__ == "__main__":
    main()
