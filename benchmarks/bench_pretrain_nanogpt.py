"""Time to val loss 1.89 on shakespeare-char: nanoGPT's own train.py against `lmforge pretrain`.

nanoGPT is the unmodified copy in ../shared/anchors/nanoGPT (train.py, model.py, its
data/shakespeare_char/prepare.py), copied to a scratch folder, its data prepared there by its own
prepare.py, and run with its README CPU recipe:

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
      --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
      --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0

lmforge runs `lmforge pretrain --config configs/shakespeare-char-fast.yaml --seed S` (by default;
`--config` picks another). Both are separate processes started the same way, with the same
OMP_NUM_THREADS, alternating (nanoGPT, lmforge, nanoGPT, lmforge, ...), and each is timed from
process start to the first evaluation line showing val loss <= the target (both evaluate every
250 iterations over 20 x 12 blocks of 64 tokens of the validation split, and their evaluation time
counts); the process is then stopped. Each side's data is prepared before the clock starts
(nanoGPT's prepare.py; lmforge's tokenizer and token shards, which a run reuses). nanoGPT's
train.py fixes its seed (1337); lmforge runs seeds 1337, 1338, 1339.

    python benchmarks/bench_pretrain_nanogpt.py [--seeds 3] [--threads 1] [--record]

Prints each run's time to the target, the ratio lmforge / nanoGPT per pair and of the means, the
host load beside each run, and (for lmforge) the val loss of the saved model on the whole
validation split. --record writes benchmarks/results/pretrain_nanogpt.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lmforge.data.corpus import shared_data_dir  # noqa: E402

ANCHOR = shared_data_dir().parent / "anchors" / "nanoGPT"
CONFIG = ROOT / "configs" / "shakespeare-char-fast.yaml"
NANOGPT_ARGS = [
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
    "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
    "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0",
]  # fmt: skip
# the evaluation lines: nanoGPT "step 250: train loss 2.0, val loss 2.1", ours "step 250:
# train 2.0, val 2.1, ..."
NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")
LMFORGE_EVAL = re.compile(r"^step (\d+): train ([\d.]+), val ([\d.]+)")


def load() -> str:
    """The 1-minute load average, for the record beside each timing."""
    return f"{os.getloadavg()[0]:.2f}"


def prepare_nanogpt(scratch: Path) -> Path:
    """An unmodified copy of nanoGPT in `scratch`, its shakespeare_char data built by its own
    prepare.py from the shared tinyshakespeare.txt (the file it would download)."""
    dest = scratch / "nanoGPT"
    shutil.copytree(ANCHOR, dest, ignore=shutil.ignore_patterns("out*", "*.bin", "*.pkl"))
    data = dest / "data" / "shakespeare_char"
    shutil.copy(shared_data_dir() / "tinyshakespeare.txt", data / "input.txt")
    subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, capture_output=True)
    return dest


def prepare_lmforge(config: str, scratch: Path) -> Path:
    """lmforge's tokenizer and token shards for `config`, built once before any timing (as
    nanoGPT's prepare.py is): each timed run starts from a copy, which its cache reuses."""
    from lmforge.data import prepare_corpus
    from lmforge.train.config import TrainConfig, build_config
    from lmforge.train.pretrain import build_tokenizer

    dest = scratch / "lmforge_data"
    cfg = build_config(TrainConfig, config, {"out_dir": str(dest)})
    dest.mkdir(parents=True)
    tokenizer = build_tokenizer(cfg, dest)
    tokenizer.save(dest)
    prepare_corpus(cfg.data, tokenizer, dest / "data", val_fraction=cfg.val_fraction,
                   text_field=cfg.text_field, progress=False)  # fmt: skip
    return dest


def timed_run(cmd: list[str], cwd: Path, pattern: re.Pattern, target: float, threads: int,
              log: Path, limit: float, finish: bool = False) -> dict:  # fmt: skip
    """Run `cmd` until an evaluation line shows val loss <= target (then stop it, or with
    `finish` let it end by itself: lmforge's target_loss saves the model and stops), the process
    ends, or `limit` seconds pass. Returns seconds to the target (None if not reached), the step
    and val loss there, and the last evaluation seen; the output goes to `log`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    watchdog = threading.Timer(limit, proc.kill)  # also when it stops printing
    watchdog.start()
    out = {"seconds": None, "step": None, "val": None, "last": None}
    with open(log, "w") as fh:
        for line in proc.stdout:
            fh.write(line)
            m = pattern.match(line.strip())
            if m:
                step, val = int(m.group(1)), float(m.group(3))
                out["last"] = (step, val)
                if val <= target:
                    out.update(seconds=time.perf_counter() - start, step=step, val=val)
                    break
        if finish and out["seconds"] is not None:
            fh.write(proc.stdout.read())  # the rest of its output, until it exits
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    watchdog.cancel()
    return out


def full_val_loss(out_dir: Path) -> float:
    """Val loss of the model saved in out_dir over the whole validation split (every block)."""
    import torch

    from lmforge.data import TokenShard
    from lmforge.lm import LM
    from lmforge.train.config import TrainConfig
    from lmforge.train.pretrain import evaluate

    lm = LM.load(out_dir)
    shard = TokenShard.open(out_dir / "data" / "val.bin")
    block = 64
    cfg = TrainConfig(batch_size=1, block_size=block, eval_iters=len(shard) // (block + 1))
    loss, _ = evaluate(lm.model, shard, cfg, torch.device("cpu"), contextlib.nullcontext)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", type=float, default=1.89)
    parser.add_argument("--limit", type=float, default=1200, help="seconds per run at most")
    parser.add_argument("--logs", default=None, help="keep the runs' logs in this folder")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if not (shared_data_dir() / "tinyshakespeare.txt").is_file() or not ANCHOR.is_dir():
        sys.exit(f"skipped: needs {shared_data_dir() / 'tinyshakespeare.txt'} and {ANCHOR}")
    rows, ratios, ours_s, ref_s = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        logs = Path(args.logs) if args.logs else scratch / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        nanogpt = prepare_nanogpt(scratch)
        prepared = prepare_lmforge(args.config, scratch)
        for i in range(args.seeds):
            seed = 1337 + i
            load_ref = load()
            ref_cmd = [sys.executable, "train.py", *NANOGPT_ARGS]
            ref = timed_run(ref_cmd, nanogpt, NANOGPT_EVAL, args.target, args.threads,
                            logs / f"nanogpt_{i}.log", args.limit)  # fmt: skip
            out_dir = scratch / f"lmforge_{seed}"
            shutil.copytree(prepared, out_dir)
            cmd = [sys.executable, "-m", "lmforge.cli.main", "pretrain", "--config", args.config,
                   "--out_dir", str(out_dir), "--seed", str(seed), "--samples", "0"]  # fmt: skip
            load_ours = load()
            ours = timed_run(cmd, ROOT, LMFORGE_EVAL, args.target, args.threads,
                             logs / f"lmforge_{seed}.log", args.limit, finish=True)  # fmt: skip
            full = full_val_loss(out_dir) if ours["seconds"] else float("nan")
            both = ours["seconds"] and ref["seconds"]
            ratio = round(ours["seconds"] / ref["seconds"], 3) if both else None
            print(f"pair {i + 1}: nanoGPT {ref['seconds']} s (step {ref['step']}, val "
                  f"{ref['val']}, last eval {ref['last']}, load {load_ref}); lmforge seed {seed} "
                  f"{ours['seconds']} s (step {ours['step']}, val {ours['val']}, last eval "
                  f"{ours['last']}, whole val split {full:.4f}, load {load_ours}); ratio "
                  f"{ratio}", flush=True)  # fmt: skip
            if ratio is not None:
                ratios.append(ratio)
                ours_s.append(ours["seconds"])
                ref_s.append(ref["seconds"])
            rows.append([i + 1, ref["seconds"] and round(ref["seconds"], 1), ref["step"],
                         ref["val"], load_ref, seed, ours["seconds"] and round(ours["seconds"], 1),
                         ours["step"], ours["val"], round(full, 4), load_ours, ratio])  # fmt: skip
    if ratios:
        mean_ratio = statistics.mean(ours_s) / statistics.mean(ref_s)
        print(
            f"mean time to val <= {args.target}: nanoGPT {statistics.mean(ref_s):.1f} s, "
            f"lmforge {statistics.mean(ours_s):.1f} s; ratio of means {mean_ratio:.3f}; "
            f"worst pair {max(ratios):.3f} (goal: <= 0.5, each <= 0.6)"
        )
        mean_ref, mean_ours = round(statistics.mean(ref_s), 1), round(statistics.mean(ours_s), 1)
        rows.append(["mean", mean_ref, "", "", "", "", mean_ours, "", "", "", "",
                     round(mean_ratio, 3)])  # fmt: skip
    if args.record:
        from benchmarks.results import record

        record(
            "pretrain_nanogpt",
            f"Time to val loss {args.target} on shakespeare-char: nanoGPT's train.py vs lmforge",
            [
                "pair",
                "nanoGPT s",
                "nanoGPT step",
                "nanoGPT val",
                "load",
                "lmforge seed",
                "lmforge s",
                "lmforge step",
                "lmforge val",
                "lmforge whole-val",
                "load",
                "lmforge / nanoGPT",
            ],
            rows,
            notes=(
                f"Seconds from process start to the first evaluation line with val loss <= "
                f"{args.target} (both: every 250 iterations, 20 x 12 blocks of 64 tokens; "
                f"evaluation time counted), alternating nanoGPT / lmforge, OMP_NUM_THREADS="
                f"{args.threads} each, on a host shared with other jobs (load = 1-minute load "
                f"average at each start). nanoGPT: its unmodified train.py, README CPU recipe "
                f"(4 layers, 4 heads, 128 wide, block 64, batch 12, AdamW, 2000 iterations), "
                f"fixed seed 1337. lmforge: {Path(args.config).name}. lmforge scores the first "
                f"240 blocks of the validation split (the same ones every time), nanoGPT 240 "
                f"random ones per evaluation; the first blocks are easier than the split as a "
                f"whole, so 'whole-val' gives the saved lmforge model's loss over every block."
            ),
        )


if __name__ == "__main__":
    main()
