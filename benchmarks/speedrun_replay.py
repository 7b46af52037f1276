"""Choose how the speedrun's SFT, DPO and GRPO keep language: candidates scored on VALIDATION data.

    python benchmarks/speedrun_replay.py --base out/speedrun-cpu-tiny --stage sft \
        --candidates baseline replay1 lora --out /tmp/replay-select

`--base` is a speedrun folder whose earlier stages are finished (tokenizer and pretrain for
`--stage sft`; also sft for dpo and grpo). Each candidate reruns that one stage with the
cpu-tiny plan plus the candidate's overrides, in its own folder (earlier stages linked), and is
scored on data the speedrun's report never shows:

  docs ppl   perplexity on the pretraining validation shard AFTER the tokens the report scores
             (val.bin[ppl_tokens:]; the report's eval stage scores val.bin[:ppl_tokens])
  ratio      that perplexity / the pretrained model's on the same tokens (the target is <= 1.5)
  val acc    greedy exact match on train-split problems that no stage trains on (the report's
             accuracy is on the test split)

Results are appended to OUT/results.jsonl and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from lmforge.fileio import write_json

CANDIDATES: dict[str, dict[str, dict]] = {
    "sft": {
        "baseline": {},
        "replay1": {"replay_coef": 1.0},
        "replay0.5": {"replay_coef": 0.5},
        "replay1-b4": {"replay_coef": 1.0, "replay_batch_size": 4},
        "replay1-b2": {"replay_coef": 1.0, "replay_batch_size": 2},
        "replay0.5-b4": {"replay_coef": 0.5, "replay_batch_size": 4},
        "replay1-b4-s600": {
            "replay_coef": 1.0,
            "replay_batch_size": 4,
            "max_iters": 600,
            "eval_interval": 300,
        },
        "replay1-b4-s225": {
            "replay_coef": 1.0,
            "replay_batch_size": 4,
            "max_iters": 225,
            "eval_interval": 225,
        },
        "lr3e-4": {"lr": 3.0e-4, "min_lr": 3.0e-5},
        "steps150": {"max_iters": 150, "eval_interval": 150},
        "lora": {"peft": "lora", "lora_targets": "qkv_proj,o_proj,up_proj,down_proj"},
        "replay1-lr5e-4": {"replay_coef": 1.0, "lr": 5.0e-4, "min_lr": 5.0e-5},
    },
    "dpo": {
        "baseline": {},
        "replay1": {"replay_coef": 1.0},
        "replay0.5": {"replay_coef": 0.5},
        "replay1-b4": {"replay_coef": 1.0, "replay_batch_size": 4},
    },
    "grpo": {
        "baseline": {},
        "noreplay": {"replay_coef": 0.0},
        "replay1": {"replay_coef": 1.0},
        "replay0.5": {"replay_coef": 0.5},
        "replay1-b4": {"replay_coef": 1.0, "replay_batch_size": 4},
    },
}
EARLIER = {"sft": ("tokenizer", "pretrain"), "dpo": ("tokenizer", "pretrain", "sft"),
           "grpo": ("tokenizer", "pretrain", "sft")}  # fmt: skip


def validation_records(task_source: str, n: int, task: str) -> list[dict]:
    """Train-split problems that no speedrun stage trains on (every stage draws its problems
    with seed 1337 from the train split, at most 5,000 of them; see presets.BASE)."""
    from lmforge.align.data import load_prompts

    def key(r: dict) -> str:
        p = r["prompt"]
        return p[-1]["content"] if isinstance(p, list) else p

    used = {key(r) for r in load_prompts(task_source, 5000, seed=1337, split="train")}
    pool = load_prompts(task_source, 3 * n + 5000, seed=2024, split="train")
    out = [r for r in pool if key(r) not in used][:n]
    if len(out) < n:
        raise SystemExit(f"only {len(out)} validation problems for {task}")
    return out


def score(model_dir: Path, base: Path, records: list[dict], ppl_tokens: int) -> dict[str, float]:
    import numpy as np

    from lmforge.align.sft import greedy_accuracy
    from lmforge.data.shards import TokenShard
    from lmforge.eval.perplexity import perplexity
    from lmforge.lm import LM

    lm = LM.load(model_dir)
    lm.model.eval()
    ids = np.asarray(TokenShard.open(base / "pretrain" / "data" / "val.bin").tokens[ppl_tokens:])
    ppl = perplexity(lm.model, ids.tolist(), lm.tokenizer.token_byte_lengths())
    return {"val_ppl": ppl.perplexity, "val_bpb": ppl.bits_per_byte,
            "val_acc": greedy_accuracy(lm, records, 6)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", required=True, type=Path)
    ap.add_argument("--stage", required=True, choices=list(CANDIDATES))
    ap.add_argument("--candidates", nargs="+", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-val", type=int, default=300)
    args = ap.parse_args()

    import torch

    from lmforge.speedrun import resolve_plan
    from lmforge.speedrun.stages import STAGES, RunContext

    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    plan0 = resolve_plan("cpu-tiny")
    records = validation_records(f"task:{plan0['task']}:chat", args.n_val, plan0["task"])
    ppl_tokens = plan0["eval"]["ppl_tokens"]
    base = args.base.resolve()
    reference = score(base / "pretrain", base, records, ppl_tokens)
    print(f"pretrained: {reference}")
    for name in args.candidates:
        over = CANDIDATES[args.stage][name]
        run = args.out / f"{args.stage}-{name}"
        run.mkdir(parents=True, exist_ok=True)
        for stage in EARLIER[args.stage]:
            link = run / stage
            if not link.exists():
                os.symlink(base / stage, link)
        plan = resolve_plan("cpu-tiny", overrides={f"{args.stage}.{k}": v for k, v in over.items()})
        ctx = RunContext(plan, run, log=lambda *a: None, progress=False)
        t0 = time.perf_counter()
        numbers = STAGES[args.stage].run(ctx)
        seconds = time.perf_counter() - t0
        row = {"stage": args.stage, "candidate": name, "overrides": over, "seconds": seconds,
               **score(ctx.dir(args.stage), base, records, ppl_tokens)}  # fmt: skip
        row["ratio"] = row["val_ppl"] / reference["val_ppl"]
        row["trainer_exact_match"] = numbers.get("exact_match")
        print(json.dumps(row))
        with open(args.out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    write_json(args.out / "pretrained.json", reference)


if __name__ == "__main__":
    main()
