"""Reproduce the post-training acceptance figures on CPU (issue 5), from the configs/align YAMLs.

  1. SFT a tiny model from scratch on 2-digit addition (the "pretrained+SFT" start).
  2. DPO on verifier-labelled pairs: held-out implicit-reward preference accuracy (target >= 80%).
  3. A reward model on the same kind of pairs: held-out pair accuracy (target >= 90%), then per kind
     of near miss on 500 more held-out problems (so a gap would show if it only caught easy ones).
  4. Continual learning of subtraction: replay vs plain full fine-tuning, both stopped at the same
     held-out new-task loss; old-task (addition) loss increase = forgetting (target: replay less).

  python benchmarks/align_targets.py [--out out/align] [--skip-sft]

Each stage is an ordinary trainer run (also `lmforge sft|dpo|reward|continual --config ...`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lmforge.align.continual import ContinualConfig, ContinualTrainer
from lmforge.align.dpo import DPOConfig, DPOTrainer
from lmforge.align.reward import RewardConfig, RewardModel, RewardTrainer
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.tasks import synthetic
from lmforge.train.config import build_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "align"


def run(cls, trainer_cls, name: str, **overrides):
    cfg = build_config(cls, CONFIGS / name, {"progress": False, **overrides})
    t0 = time.perf_counter()
    result = trainer_cls(cfg, log=lambda *a: None).run()
    print(f"  [{name}] {time.perf_counter() - t0:.0f} s wall, {result['step']} steps")
    return result


def near_miss_report(rm_dir: Path, n: int = 500) -> str:
    """Held-out pair accuracy of a saved reward model for each kind of wrong sum."""
    rm, tok = RewardModel.load(rm_dir)
    kinds = {"+1": 1, "-1": -1, "+2": 2, "-2": -2, "+10": 10, "-10": -10}
    texts, groups = [], []
    for r in synthetic.problems("add", n, seed=2024, split="test", digits=2):
        value = int(r["answer"])
        for kind, d in kinds.items():
            if value + d >= 0:
                texts += [r["prompt"] + r["answer"], r["prompt"] + str(value + d)]
                groups.append(kind)
    scores = rm.score(texts, tok).view(-1, 2)
    hits = {k: [] for k in kinds}
    for kind, (good, bad) in zip(groups, scores.tolist()):
        hits[kind].append(good > bad)
    return "  ".join(f"{k}: {sum(v) / len(v):.1%}" for k, v in hits.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/align")
    ap.add_argument("--skip-sft", action="store_true", help="reuse OUT/sft_add")
    args = ap.parse_args()
    out = Path(args.out)
    sft_dir = str(out / "sft_add")
    rows = []

    if not args.skip_sft:
        r = run(SFTConfig, SFTTrainer, "sft_add.yaml", out_dir=sft_dir)
        print(f"SFT: held-out exact match {r['initial_exact_match']:.1%} -> {r['exact_match']:.1%}")

    r = run(DPOConfig, DPOTrainer, "dpo_add.yaml", init=sft_dir, out_dir=str(out / "dpo_add"))
    rows.append(("DPO held-out preference accuracy (implicit reward)", r["accuracy"], 0.80))

    r = run(RewardConfig, RewardTrainer, "reward_add.yaml", init=sft_dir,
            out_dir=str(out / "reward_add"))  # fmt: skip
    rows.append(("reward model held-out pair accuracy", r["accuracy"], 0.90))
    print(f"reward model, per near miss: {near_miss_report(out / 'reward_add')}")

    results = {}
    for reg in ("none", "replay"):
        results[reg] = run(ContinualConfig, ContinualTrainer, "continual_sub.yaml", init=sft_dir,
                           regularizer=reg, out_dir=str(out / f"continual_{reg}"))  # fmt: skip
    plain, replay = results["none"], results["replay"]
    print(
        f"continual: plain full FT forgetting {plain['forgetting']:.3f} (new-task loss "
        f"{plain['new_loss_after']:.3f}, {plain['step']} steps); replay forgetting "
        f"{replay['forgetting']:.3f} (new-task loss {replay['new_loss_after']:.3f}, "
        f"{replay['step']} steps); old-task loss before {plain['old_loss_before']:.3f}"
    )
    ok = replay["forgetting"] < plain["forgetting"]
    print()
    for name, value, target in rows:
        print(
            f"{name}: {value:.1%} (target >= {target:.0%}) {'PASS' if value >= target else 'FAIL'}"
        )
    print(f"continual forgets less than plain fine-tuning: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
