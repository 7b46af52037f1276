"""Validation figures for choosing between runs of a task recipe (dpo-arith, grpo-arith), on more
problems than a run's periodic evaluation decodes, so that differences of a few points resolve.
Reads the validation split only: it is where settings are chosen; test is for
benchmarks/recipes.py alone.

  python benchmarks/recipe_validation.py --name dpo-arith-cpu-v1 \\
      --start out/recipes/lora-sft-arith-cpu --pairs 512 --out DIR --reuse \\
      --models out/recipes/dpo-arith-cpu out/recipes/dpo-arith-cpu-sft-baseline

For the start model and each of --models:
  - greedy exact match on the first --n problems of `--task`'s validation split (as recipes.py
    scores test: up to 8 new tokens, the task's verifier);
  - with --near-miss N, implicit-reward accuracy (relative to the start model) and likelihood
    accuracy on the task's own pairs for the first N validation problems: the right answer
    against the task's canned near miss (off by one, two or ten, or two digits swapped), the
    pairs recipes.py scores on test as implicit_reward_accuracy;
  - with --pairs, implicit-reward accuracy (relative to the start model) and likelihood accuracy
    on on-policy validation pairs: the start model's own right and wrong answers to the first
    --pairs validation prompts, built as a `pairs_from: policy` run builds its training pairs
    (8 samples at T = 1, one pair per prompt: recipes.ARITH_POLICY_PAIRS's settings).
Every model is compared with every other by paired 95% bootstrap intervals (protocol.py); the
table goes to benchmarks/results/recipe-validation-NAME.json. Each scoring runs as a stage of
recipes.py (own process, wall and CPU time, peak RSS; --reuse skips finished ones in --out).
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import recipes
from protocol import paired_bootstrap


def pair_accuracies(got: dict[str, dict], start: str, prefix: str) -> dict[str, dict]:
    """Per-pair implicit-reward wins (relative to `start`) and likelihood wins of each model's
    scored pairs (got: {model: a preference stage's result})."""
    c0, r0 = got[start]["chosen"], got[start]["rejected"]
    return {
        f"{prefix}implicit_reward_accuracy": {
            m: recipes.wins([(a - a0) - (b - b0) for a, a0, b, b0 in
                             zip(g["chosen"], c0, g["rejected"], r0)])
            for m, g in got.items()},
        f"{prefix}likelihood_accuracy": {
            m: recipes.wins([a - b for a, b in zip(g["chosen"], g["rejected"])])
            for m, g in got.items()},
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True, help="the recipe run compared (the record's name)")
    ap.add_argument("--start", required=True, help="the starting model (the DPO reference)")
    ap.add_argument("--models", nargs="+", required=True, help="trained models to compare")
    ap.add_argument("--task", default="task:arith:2:validation:chat")
    ap.add_argument("--n", type=int, default=512, help="validation problems for exact match")
    ap.add_argument("--pairs", type=int, default=0, help="validation prompts for on-policy pairs")
    ap.add_argument("--near-miss", type=int, default=0, help="problems for the task's own pairs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reuse", action="store_true")
    args = ap.parse_args()
    if not args.task.endswith((":validation", ":validation:chat")):
        raise SystemExit(f"--task must be a validation split, got {args.task}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(recipes.ROOT)
    recipes.REUSE = args.reuse
    base = {"device": "cpu", "threads": 1}
    models = [args.start, *args.models]
    label = {m: Path(m).name for m in models}
    scores: dict[str, dict[str, list[float]]] = {"exact_match": {}}
    stages = {}
    for m in models:
        job = {**base, "kind": "task", "test": args.task, "n": args.n, "max_new_tokens": 8,
               "batch": 128, "max_len": 64, "model": m}  # fmt: skip
        stages[f"em-{label[m]}"] = r = recipes.stage(f"val-em-{label[m]}", job, out)
        scores["exact_match"][m] = r["scores"]
    pairs_note = ""
    if args.near_miss:
        got = {}
        for m in models:
            job = {**base, "kind": "preference", "test": args.task, "n": args.near_miss,
                   "max_len": 64, "model": m}  # fmt: skip
            got[m] = recipes.stage(f"val-nm-{label[m]}", job, out)
        scores.update(pair_accuracies(got, args.start, ""))
        pairs_note += (f" Near-miss pairs: the task's own, right answer against its canned near "
                       f"miss, first {args.near_miss} validation problems.")  # fmt: skip
    if args.pairs:
        settings = {**recipes.ARITH_POLICY_PAIRS["cpu"], "n": args.pairs}
        job = {**base, **settings, "kind": "policy-pairs", "test": args.task, "max_len": 64,
               "model": args.start}  # fmt: skip
        sampled = recipes.stage("val-pairs", job, out)
        pairs_note += (f" On-policy pairs: {len(sampled['pairs'])} from the start model's answers "
                      f"to the first {args.pairs} validation prompts ({sampled['unpaired']} gave "
                      f"none), {settings['samples']} samples each at T = "
                      f"{settings['temperature']}, one pair per prompt.")  # fmt: skip
        got = {}
        for m in models:
            job = {**base, "kind": "policy-preference", "pairs": str(out / "val-pairs.result.json"),
                   "model": m}  # fmt: skip
            got[m] = recipes.stage(f"val-pp-{label[m]}", job, out)
        scores.update(pair_accuracies(got, args.start, "onpolicy_"))
    rows = []
    for metric, per_model in scores.items():
        for m, s in per_model.items():
            rows.append([metric, label[m], f"{sum(s) / len(s):.4f}", len(s)])
        for a, b in itertools.combinations(models, 2):
            diff = paired_bootstrap(per_model[b], per_model[a], 10_000)
            rows.append([metric, f"{label[b]} − {label[a]}", str(diff), len(per_model[a])])
    for row in rows:
        print(" | ".join(str(v) for v in row))
    from results import record

    record(f"recipe-validation-{args.name}",
           f"Recipe validation ({args.name}): SmolLM2-135M-Instruct runs compared on validation",
           ["metric", "model (or difference, paired 95% bootstrap)", "value", "n"], rows,
           f"Validation split `{args.task}` only (settings are chosen here; test is read by "
           f"benchmarks/recipes.py alone). Exact match: greedy, first {args.n} problems, up to "
           f"8 new tokens.{pairs_note} Implicit reward relative to {label[args.start]}. "
           "1 thread. Discussion: docs/recipes.md.")  # fmt: skip


if __name__ == "__main__":
    main()
