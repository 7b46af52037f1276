"""Post-training acceptance figures on the built-in 2-digit addition task (CPU), from the
configs/align YAMLs, under the honest protocol of issue 20.

  1. SFT a tiny model from scratch on addition (the "pretrained+SFT" start of the stages below).
  2. DPO on verifier-labelled pairs (target: test implicit-reward preference accuracy >= 80%),
     against a compute-matched baseline: the start trained further with plain SFT on the chosen
     answers of the same pairs (same steps, pairs per step, lr).
  3. A reward model on the same kind of pairs: test pair accuracy (target >= 90%), also per kind
     of near miss on 500 test problems (so a gap would show if it only caught easy ones).
  4. Continual learning of subtraction with replay, against plain full fine-tuning of the start
     for as many steps and rows: old-task (addition) and new-task test exact match.

Protocol. Trainers evaluate periodically on the task's validation split (train, validation and
test are disjoint buckets of a prompt hash, lmforge/tasks/synthetic.py); the checkpoint reported
is the one with the best validation figure (KEEP; exported to OUT_DIR/best, its step in
best/chosen.json), and replay stops at a validation new-task loss. The test split is read only
afterwards, per example; every comparison is printed as a difference with its paired 95%
bootstrap interval (protocol.paired_bootstrap, 10,000 resamples), and protocol.check_held_out
asserts that no test prompt is among a run's train or validation prompts. The figures are those
of the next full run (the README quotes them); earlier ones were chosen on test and are dropped.

  python benchmarks/align_targets.py [--out out/align] [--skip-sft]
  python benchmarks/align_targets.py --smoke --out /tmp/align     # every stage, a few steps

Each stage is an ordinary trainer run (also `lmforge sft|dpo|reward|continual --config ...`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from protocol import check_held_out, paired_bootstrap

from lmforge.align import data as D
from lmforge.align.continual import ContinualConfig, ContinualTrainer
from lmforge.align.dpo import DPOConfig, DPOTrainer, completion_logprob_sums
from lmforge.align.reward import RewardConfig, RewardModel, RewardTrainer
from lmforge.align.sft import SFTConfig, SFTTrainer
from lmforge.align.trainer import eval_source
from lmforge.lm import LM
from lmforge.tasks import synthetic
from lmforge.tasks.answers import verify
from lmforge.train.config import build_config, flat_fields

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "align"
KEEP = {"sft": "exact_match", "dpo": "accuracy", "reward": "accuracy", "continual": "loss",
        "grpo": "exact_match", "ppo": "exact_match", "rsft": "exact_match"}  # fmt: skip
SMOKE = {"max_iters": 4, "eval_interval": 2, "n_train": 64, "n_eval": 16, "eval_generate": 16,
         "batch_size": 8, "warmup_iters": 0}  # fmt: skip
SEEN: dict[str, list[str]] = {}  # prompts some run trained or chose on, by split


def keep_best(trainer_cls):
    """trainer_cls exporting its model to OUT_DIR/best at each periodic evaluation (on
    validation) that improves KEEP[name] (a loss: lower), with the step in best/chosen.json."""
    metric, sign = KEEP[trainer_cls.name], -1 if KEEP[trainer_cls.name] == "loss" else 1

    class KeepBest(trainer_cls):
        best = None

        def __init__(self, cfg, resume: bool = False, **kw):
            super().__init__(cfg, resume=resume, **kw)
            if resume and (chosen := self.out_dir / "best" / "chosen.json").is_file():
                self.best = json.loads(chosen.read_text())[metric]  # the best before resuming

        def should_stop(self, evaluated: dict[str, float]) -> bool:
            if (value := evaluated.get(metric)) is not None and (
                self.best is None or sign * value > sign * self.best
            ):
                self.best = value
                self.export(self.out_dir / "best")
                chosen = {"step": self.step, metric: value}
                (self.out_dir / "best" / "chosen.json").write_text(json.dumps(chosen))
            return super().should_stop(evaluated)

    return KeepBest


def prompts(source, n: int, seed: int, split: str) -> list[str]:
    return [r["prompt"] for r in D.load_prompts(source, n, seed, split)]


def note_seen(cfg) -> None:
    """Record the prompts a run trains on and chooses on (its periodic evaluation)."""
    source, split = eval_source(cfg)
    n_eval = max(cfg.n_eval, cfg.greedy_eval.eval_generate if hasattr(cfg, "greedy_eval") else 0)
    SEEN.setdefault("train", []).extend(prompts(cfg.data, cfg.n_train, cfg.seed, "train"))
    SEEN.setdefault("validation", []).extend(prompts(source, n_eval, cfg.seed + 1, split))
    if old := getattr(cfg, "old_data", None):
        SEEN["train"] += prompts(old, cfg.n_train, cfg.seed + 2, "train")
        SEEN["validation"] += prompts(old, cfg.n_eval, cfg.seed + 3, "validation")


def fields(cls, smoke: bool, **overrides) -> dict:
    names = set(flat_fields(cls))
    return {"progress": False, **overrides,
            **{k: v for k, v in (SMOKE if smoke else {}).items() if k in names}}  # fmt: skip


def run(cls, trainer_cls, name: str | None, smoke: bool, **overrides) -> tuple[dict, Path]:
    """Train (config CONFIGS/name, else the dataclass defaults) and return (final metrics, the
    checkpoint chosen on validation)."""
    over = fields(cls, smoke, **overrides)
    cfg = build_config(cls, CONFIGS / name, over) if name else cls(**over)
    note_seen(cfg)
    t0 = time.perf_counter()
    result = keep_best(trainer_cls)(cfg, log=lambda *a: None).run()
    best = Path(cfg.out_dir) / "best"
    chosen = json.loads((best / "chosen.json").read_text())
    print(f"  [{name or cfg.out_dir}] {time.perf_counter() - t0:.0f} s wall, {result['step']} "
          f"steps; chosen on validation: {chosen}")  # fmt: skip
    return result, best


def exact_matches(model: Path, records: list[dict], max_new_tokens: int = 6) -> list[float]:
    """Per record, 1.0 if the greedy completion is verified right, else 0.0."""
    lm = LM.load(model)
    tok, out = lm.tokenizer, []
    for i in range(0, len(records), 128):
        chunk = records[i : i + 128]
        ids = lm.generate(
            [D.prompt_ids(r, tok) for r in chunk], max_new_tokens=max_new_tokens, temperature=0.0
        )
        out += [verify(r, tok.decode(x, skip_special_tokens=True)) for r, x in zip(chunk, ids)]
    return out


def implicit_reward_wins(model: Path, reference: Path, pairs: list[dict]) -> list[float]:
    """Per pair, 1 if log π(chosen)/π_ref(chosen) > log π(rejected)/π_ref(rejected) (½ on ties):
    DPO's implicit-reward preference accuracy, π_ref the starting model."""
    margins = []
    for path in (model, reference):
        lm = LM.load(path)
        examples = D.load_preferences(pairs, lm.tokenizer, 32).examples
        with torch.no_grad():
            batch = D.collate_preferences(examples, lm.tokenizer.pad_id or 0)
            chosen, rejected = completion_logprob_sums(lm.model, batch).chunk(2)
        margins.append(chosen - rejected)
    m = margins[0] - margins[1]
    return ((m > 0).float() + 0.5 * (m == 0).float()).tolist()


def claim(label: str, a: list[float], b: list[float] | None = None):
    """Print mean(a) - mean(b) with its paired 95% bootstrap interval (no b: mean(a) and its
    interval) and return the interval."""
    iv = paired_bootstrap(a, b or [0.0] * len(a))
    print(f"{label}: {iv.diff:.3f} [{iv.low:.3f}, {iv.high:.3f}] (95% bootstrap, n={iv.n})"
          if b is None else f"{label}: {sum(a) / len(a):.3f} vs {sum(b) / len(b):.3f}, "
          f"difference {iv} (paired 95% bootstrap, n={iv.n})")  # fmt: skip
    return iv


def near_miss_report(rm_dir: Path, n: int) -> str:
    """Test pair accuracy of a saved reward model for each kind of wrong sum."""
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
    ap.add_argument("--smoke", action="store_true", help="a few steps and examples per stage")
    args = ap.parse_args()
    out, smoke = Path(args.out), args.smoke
    n_test, n_pairs = (40, 40) if smoke else (1000, 500)
    test = {
        t: D.load_prompts(f"task:{t}:2", n_test, seed=1338, split="test") for t in ("add", "sub")
    }
    pairs = synthetic.preference_pairs("add", n_pairs, seed=2024, split="test", digits=2)
    targets = []

    sft_dir = out / "sft_add" / "best"
    if not args.skip_sft:
        run(SFTConfig, SFTTrainer, "sft_add.yaml", smoke, out_dir=str(out / "sft_add"))
    start = exact_matches(sft_dir, test["add"])
    claim("SFT start, test exact match (addition)", start)

    dpo, dpo_dir = run(DPOConfig, DPOTrainer, "dpo_add.yaml", smoke, init=str(sft_dir),
                       out_dir=str(out / "dpo_add"))  # fmt: skip
    d = build_config(DPOConfig, CONFIGS / "dpo_add.yaml", fields(DPOConfig, smoke))
    _, base_dir = run(SFTConfig, SFTTrainer, None, smoke, init=str(sft_dir), data=d.data,
                      out_dir=str(out / "dpo_sft_baseline"), n_train=d.n_train, n_eval=d.n_eval,
                      batch_size=d.batch_size, max_iters=d.optim.max_iters, lr=d.optim.lr,
                      min_lr=d.optim.min_lr, warmup_iters=d.optim.warmup_iters,
                      eval_interval=d.optim.eval_interval,
                      max_len=d.max_len, threads=d.threads, eval_generate=200)  # fmt: skip
    wins = {m: implicit_reward_wins(p, sft_dir, pairs) for m, p in (("dpo", dpo_dir),
                                                                   ("sft", base_dir))}  # fmt: skip
    targets.append(("DPO test implicit-reward preference accuracy", wins["dpo"], 0.80))
    claim("DPO - SFT baseline, test implicit-reward preference accuracy", wins["dpo"], wins["sft"])
    em = {"dpo": exact_matches(dpo_dir, test["add"]), "sft": exact_matches(base_dir, test["add"])}
    claim("DPO - SFT baseline, test exact match", em["dpo"], em["sft"])
    claim("DPO - start, test exact match", em["dpo"], start)

    _, rm_dir = run(RewardConfig, RewardTrainer, "reward_add.yaml", smoke, init=str(sft_dir),
                    out_dir=str(out / "reward_add"))  # fmt: skip
    rm, tok = RewardModel.load(rm_dir)
    scores = rm.score([p["prompt"] + s for p in pairs for s in (p["chosen"], p["rejected"])], tok)
    rm_hits = [float(g > b) for g, b in scores.view(-1, 2).tolist()]
    targets.append(("reward model test pair accuracy", rm_hits, 0.90))
    print(f"reward model, per near miss (test): {near_miss_report(rm_dir, n_pairs)}")

    replay, replay_dir = run(ContinualConfig, ContinualTrainer, "continual_sub.yaml", smoke,
                             init=str(sft_dir), out_dir=str(out / "continual_replay"))  # fmt: skip
    # the compute-matched baseline: plain full fine-tuning, as many steps (and rows) as replay
    plain, plain_dir = run(
        ContinualConfig,
        ContinualTrainer,
        "continual_sub.yaml",
        smoke,
        init=str(sft_dir),
        regularizer="none",
        stop_at_new_loss=None,
        max_iters=replay["step"],
        out_dir=str(out / "continual_plain"),
    )
    print(f"continual (validation): forgetting (old-task loss increase) replay "
          f"{replay['forgetting']:.3f}, plain {plain['forgetting']:.3f}")  # fmt: skip
    em = {t: [exact_matches(d, test[t]) for d in (replay_dir, plain_dir)] for t in test}
    kept = claim("replay - plain fine-tuning, old-task (addition) test exact match", *em["add"])
    claim("replay - plain fine-tuning, new-task (subtraction) test exact match", *em["sub"])
    claim("replay - start, old-task test exact match", em["add"][0], start)
    claim("plain fine-tuning - start, old-task test exact match", em["add"][1], start)

    check_held_out([r["prompt"] for t in test.values() for r in t] + [p["prompt"] for p in pairs],
                   **SEEN)  # fmt: skip
    print()
    for name, scores, target in targets:  # PASS / FAIL: the whole interval above / below
        iv = claim(f"{name} (target >= {target:.0%})", scores)
        print(f"  {'PASS' if iv.low >= target else 'FAIL' if iv.high < target else 'UNDECIDED'}")
    print(
        "replay keeps more of the old task than plain fine-tuning (interval above 0): "
        f"{'PASS' if kept.low > 0 else 'FAIL' if kept.high < 0 else 'UNDECIDED'}"
    )


if __name__ == "__main__":
    main()
