"""Acceptance figures for the RL trainers on the built-in 2-digit addition task (CPU), under the
honest protocol of issue 20.

Stages (each cached in --out): SFT from scratch with lmforge's SFTTrainer (the 4-layer d_model 128
model of configs/align/sft_add.yaml, stopped at a step fixed in advance, 900, so RL has room); a
reward model on verifier-labelled pairs of that model's own samples (backbone: the same SFT run
to 1500 steps); then GRPO, PPO against the reward model and RSFT, each from the SFT model.

Protocol. Every run evaluates periodically on the task's validation split, and the checkpoint
reported is the one with the best validation exact match (align_targets.keep_best: OUT/NAME/best).
Each method has a compute-matched baseline, the SFT model trained further with plain SFT on the
same train prompts (gold answers) for as many optimizer steps and sequences per step as the
method backpropagates through (`sft_baseline`; RSFT's kept samples are at most its prompts, so
its baseline is an upper bound), chosen the same way. The test split (1000 problems) is read only
afterwards: greedy exact match per problem, method - baseline, method - start and baseline -
start with paired 95% bootstrap intervals (protocol.paired_bootstrap); protocol.check_held_out
asserts no test prompt was trained or chosen on. Times are CPU seconds of this process
(threads=1) and wall seconds. No figures are quoted here: the README takes them from the next full
run (earlier figures were read off the test split while choosing, and are dropped).

    python benchmarks/rl_targets.py --stage all
    python benchmarks/rl_targets.py --stage grpo --grpo.lr 2.0e-4    # override any config field
    python benchmarks/rl_targets.py --stage grpo --resume --grpo.max_iters 1000   # run on
    python benchmarks/rl_targets.py --smoke --out /tmp/rl     # every stage, a few steps
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from align_targets import SEEN, claim, exact_matches, keep_best, note_seen
from protocol import check_held_out

from lmforge.align import data as D
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.train.config import parse_overrides

# The configs/align/sft_add.yaml model, stopped early (900 of its 1500 steps) so RL has room.
SFT_MODEL = {"n_layer": 4, "n_head": 4, "d_model": 128, "max_seq_len": 24}
COMMON = {"data": "task:add:2", "threads": 1, "progress": False, "max_len": 32}
SMOKE = {"sft": {"max_iters": 4, "eval_interval": 2, "n_train": 64, "eval_generate": 8},
         "reward": {"n_train": 16, "n_eval": 8, "max_iters": 2, "eval_interval": 1,
                    "pairs_from": "data"},  # a 4-step policy has no right samples to pair
         "grpo": {"max_iters": 2, "eval_interval": 1, "batch_size": 4, "n_train": 16, "n_eval": 8},
         "ppo": {"max_iters": 2, "eval_interval": 1, "batch_size": 4, "minibatch_size": 8,
                 "n_train": 16, "n_eval": 8},
         "rsft": {"max_iters": 2, "batch_size": 8, "n_train": 16, "n_eval": 8}}  # fmt: skip


def series(out: Path, split: str, metric: str) -> list[tuple[int, float]]:
    with open(out / "metrics.csv", newline="") as fh:
        return [
            (int(r["step"]), float(r["value"]))
            for r in csv.DictReader(fh)
            if r["split"] == split and r["metric"] == metric
        ]


def run_sft(root: Path, kw: dict, name: str = "sft") -> Path:
    out = root / name
    if not (out / "final_metrics.json").is_file():
        cfg = SFTConfig(**{**COMMON, "out_dir": str(out), "init": "scratch", "model": SFT_MODEL,
                           "max_len": 24,
                           "n_train": 3000, "batch_size": 32, "max_iters": 900, "lr": 2e-3,
                           "min_lr": 1e-4, "warmup_iters": 50, "eval_interval": 300,
                           "eval_generate": 200, **kw})  # fmt: skip
        note_seen(cfg)
        SFTTrainer(cfg, log=lambda *a: None).run()
    print(f"{name} validation exact match:", series(out, "eval", "exact_match"))
    return out


def run_reward(root: Path, sft: Path, kw: dict, backbone_kw: dict) -> Path:
    """configs/align/reward_onpolicy.yaml: pairs of the PPO start's own samples (`sft`, 8 per
    prompt, verifier-labelled right vs wrong), scored by a backbone SFT'd to 1500 steps."""
    from lmforge.align.reward import RewardConfig, RewardTrainer
    from lmforge.train.config import build_config

    out = root / "reward"
    if not (out / "final_metrics.json").is_file():
        backbone = run_sft(root, {"max_iters": 1500, **backbone_kw}, name="sft_rm")
        config = Path(__file__).resolve().parents[1] / "configs" / "align" / "reward_onpolicy.yaml"
        over = {"progress": False, "out_dir": str(out), "init": str(backbone),
                "pair_policy": str(sft), **kw}  # fmt: skip
        RewardTrainer(build_config(RewardConfig, config, over), log=lambda *a: None).run()
    print("reward model validation on-policy pair accuracy:", series(out, "eval", "accuracy"))
    return out


def test_records(n: int = 1000) -> list[dict]:
    """n test-split problems: read only to report, after every choice is made."""
    return D.load_prompts(COMMON["data"], n, seed=1338, split="test")


def sft_baseline(name: str, fields: dict) -> dict:
    """The compute-matched plain-SFT baseline of an RL run: from the same start, the same train
    prompts with their gold answers, as many optimizer steps of as many sequences as the method
    (rows sampled per step, split into minibatches, times its epochs over them)."""
    rows = fields["batch_size"] * (1 if name == "rsft" else fields["group_size"])
    batch = min(rows, fields.get("minibatch_size") or rows)
    epochs = fields.get(
        {"grpo": "num_iterations", "ppo": "ppo_epochs", "rsft": "sft_epochs"}[name], 1
    )
    per_step = epochs * -(-rows // batch)
    keep = ("data", "threads", "progress", "init", "n_train", "n_eval", "lr", "min_lr", "seed",
            "max_new_tokens")  # fmt: skip
    return {**{k: fields[k] for k in keep if k in fields}, "batch_size": batch,
            "max_iters": fields["max_iters"] * per_step, "out_dir": fields["out_dir"] + "_sft",
            "eval_interval": fields.get("eval_interval", 1) * per_step,
            "warmup_iters": fields.get("warmup_iters", 0) * per_step,
            "eval_generate": fields["n_eval"], "max_len": SFT_MODEL["max_seq_len"]}  # fmt: skip


def run_rl(
    name: str,
    root: Path,
    sft: Path,
    kw: dict,
    reward: Path | None = None,
    resume: bool = False,
    n_test: int = 1000,
) -> None:
    import importlib

    module = importlib.import_module(f"lmforge.align.{name}")
    cls = {"grpo": "GRPO", "ppo": "PPO", "rsft": "RSFT"}[name]
    defaults = {
        "grpo": {"batch_size": 64, "group_size": 8, "lr": 1e-4, "min_lr": 1e-4,
                 "warmup_iters": 10, "max_iters": 550, "eval_interval": 25},
        "ppo": {"batch_size": 64, "group_size": 4, "minibatch_size": 128, "ppo_epochs": 2,
                "lr": 1e-4, "min_lr": 1e-4, "max_iters": 80, "eval_interval": 20,
                "critic": "reward", "critic_warmup": 5, "score_norm": "whiten"},
        "rsft": {"batch_size": 512, "group_size": 8, "min_reward": 1.0, "sft_epochs": 3,
                 "lr": 1e-4, "min_lr": 1e-4, "max_iters": 8},
    }[name]  # fmt: skip
    extra = {"reward": str(reward)} if reward is not None else {}
    out = root / name
    fields = {**COMMON, "out_dir": str(out), "init": str(sft), "n_train": 5000, "n_eval": 200,
              "max_new_tokens": 6, **defaults, **extra, **kw}  # fmt: skip
    cfg = getattr(module, f"{cls}Config")(**fields)
    note_seen(cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    resume = resume and (out / "training_state.safetensors").is_file()
    keep_best(getattr(module, f"{cls}Trainer"))(cfg, resume=resume, log=lambda *a: None).run()
    # CPU seconds of this process (threads=1): the "minutes of CPU" the targets are stated in,
    # and what stays meaningful on a shared machine where wall time includes waiting for a core.
    print(f"{name}: {time.process_time() - c0:.0f} s CPU, {time.perf_counter() - t0:.0f} s wall")
    for split, metric in [("eval", "exact_match"), ("eval", "reward"), ("train", "reward"),
                          ("train", "kl")]:  # fmt: skip
        values = series(out, split, metric)
        if values:
            shown = [(s, round(v, 3)) for s, v in values][:: max(1, len(values) // 12)]
            print(f"  {split} {metric}: {shown}")
    base = SFTConfig(**sft_baseline(name, fields))
    note_seen(base)
    keep_best(SFTTrainer)(base, log=lambda *a: None).run()
    chosen = {"method": out / "best", "baseline": Path(base.out_dir) / "best"}
    for m, path in chosen.items():
        print(f"  {m} chosen on validation: {(path / 'chosen.json').read_text()}")
    test = test_records(n_test)
    check_held_out([r["prompt"] for r in test], **SEEN)
    em = {m: exact_matches(p, test) for m, p in {"start": sft, **chosen}.items()}
    claim(f"  {name} - SFT baseline, test exact match", em["method"], em["baseline"])
    claim(f"  {name} - start, test exact match", em["method"], em["start"])
    claim("  SFT baseline - start, test exact match", em["baseline"], em["start"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--stage", default="all", choices=["all", "sft", "reward", "grpo", "ppo", "rsft"]
    )
    p.add_argument("--out", default="out/bench/rl_targets")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue RL stages from their saved state "
        "(e.g. to a larger --grpo.max_iters; with a constant lr this equals one longer run)",
    )
    p.add_argument("--smoke", action="store_true", help="a few steps and examples per stage")
    args, rest = p.parse_known_args()
    overrides = parse_overrides(rest)
    per = {k: dict(SMOKE[k]) if args.smoke else {} for k in SMOKE}
    n_test = 40 if args.smoke else 1000
    for key, value in overrides.items():
        stage, _, field = key.partition(".")
        per[stage][field] = value
    root = Path(args.out)
    sft = run_sft(root, per["sft"])
    if args.stage in ("all", "grpo"):
        run_rl("grpo", root, sft, per["grpo"], resume=args.resume, n_test=n_test)
    if args.stage in ("all", "reward", "ppo"):
        reward = run_reward(root, sft, per["reward"], per["sft"] if args.smoke else {})
        if args.stage != "reward":
            run_rl("ppo", root, sft, per["ppo"], reward, resume=args.resume, n_test=n_test)
    if args.stage in ("all", "rsft"):
        run_rl("rsft", root, sft, per["rsft"], resume=args.resume, n_test=n_test)


if __name__ == "__main__":
    main()
