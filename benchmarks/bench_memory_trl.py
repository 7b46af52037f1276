"""Peak memory of one post-training step, lmforge vs TRL, on SmolLM2-135M-Instruct (49,152-token
vocabulary): each side runs in a fresh process and reports its peak resident set size.

lmforge computes every loss over the vocabulary a chunk of tokens at a time (its [B, T, V]
logits are never built: lmforge/align/logprobs.py); TRL builds the whole logits tensor. Both
load the same Hugging Face folder (`trl_common.smollm2_hf`), train fp32 LoRA adapters (r = 8 on
the attention projections) with activation checkpointing (TRL's default) and one optimizer step:

- dpo: `--batch` pairs of `--seq` tokens (prompt half, response half), sigmoid loss, reference
  log-probs computed in the step (TRL's default; the reference is the model with adapters off
  on both sides);
- grpo: one prompt of `--seq`/2 tokens with `--batch` completions of `--seq`/2 tokens each,
  replayed to both trainers (no sampling in the measured step), β = 0.

`--batch` takes several sizes; TRL runs only up to `--trl-max-batch` (the rows above it say
"not measured"), and every child is watched: it is killed, and its row says so, as soon as the
machine's available memory falls below `--floor` GiB, so that a step too large for the machine
never takes other processes down with it.

  python benchmarks/bench_memory_trl.py [--seq 1024] [--batch 4 8] [--trl-max-batch 4]
      [--method dpo grpo] [--floor 4]
  python benchmarks/bench_memory_trl.py --batch dpo=2 dpo=8 grpo=4 grpo=8 \\
      --trl-max-batch dpo=2 grpo=4
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from trl_common import hf_twin, smollm2_hf

MODEL_DIR = Path(tempfile.gettempdir()) / "lmforge_smollm2_hf"
WORD = " the"  # one SmolLM2 token however often it repeats


def text(tokens: int) -> str:
    return WORD * tokens


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child(method: str, side: str, seq: int, batch: int, tmp: Path) -> dict:
    torch.set_num_threads(1)
    half = seq // 2 - 2
    if method == "dpo":
        rows = [
            {
                "prompt": "Q:" + text(half),
                "chosen": "A" + text(half - 1),
                "rejected": "B" + text(half - 1),
            }
            for _ in range(batch)
        ]
    else:
        rows = [{"prompt": "Q:" + text(half), "answer": "1"}]
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))  # the tokenizer alone: no weights
    completion = hf_tok(text(half), add_special_tokens=False)["input_ids"]
    replay = [list(completion) for _ in range(batch)]
    if side == "ours":
        return ours(method, data, seq, batch, replay, tmp)
    return trl(method, rows, seq, batch, replay, hf_tok, tmp)


def ours(method, data, seq, batch, replay, tmp) -> dict:
    from lmforge.align.dpo import DPOConfig, DPOTrainer
    from lmforge.align.grpo import GRPOConfig, GRPOTrainer

    common = dict(
        init=str(MODEL_DIR),
        out_dir=str(tmp / "out"),
        data=str(data),
        eval_data=str(data),
        n_eval=1,
        max_len=seq,
        max_iters=1,
        lr=1e-5,
        peft="lora",
        activation_checkpointing=True,
        progress=False,
        threads=1,
    )
    if method == "dpo":
        cfg = DPOConfig(**common, batch_size=batch, n_train=batch, precompute_ref=False)
        trainer = DPOTrainer(cfg, log=lambda *a: None)
    else:
        cfg = GRPOConfig(
            **common, batch_size=1, group_size=batch, max_new_tokens=seq // 2, beta=0.0
        )
        trainer = GRPOTrainer(cfg, log=lambda *a: None, reward=lambda r, c: len(c) % 3)
        trainer.engine.generate = lambda *a, **k: replay
    loaded = peak_gib()
    trainer.train_step()
    return {"loaded_gib": loaded, "peak_gib": peak_gib()}


def trl(method, rows, seq, batch, replay, hf_tok, tmp) -> dict:
    import trl as trl_lib
    from datasets import Dataset
    from peft import LoraConfig

    _, model = hf_twin(MODEL_DIR)
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    common = dict(
        output_dir=str(tmp / "trl"),
        learning_rate=1e-5,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        bf16=False,
        fp16=False,
        gradient_checkpointing=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if method == "dpo":
        args = trl_lib.DPOConfig(
            **common,
            per_device_train_batch_size=batch,
            max_length=seq,
            precompute_ref_log_probs=False,
        )
        trainer = trl_lib.DPOTrainer(
            model=model,
            args=args,
            processing_class=hf_tok,
            train_dataset=Dataset.from_list(rows),
            peft_config=lora,
        )
    else:
        args = trl_lib.GRPOConfig(
            **common,
            per_device_train_batch_size=batch,
            num_generations=batch,
            max_completion_length=seq // 2,
            beta=0.0,
        )
        trainer = trl_lib.GRPOTrainer(
            model=model,
            args=args,
            processing_class=hf_tok,
            train_dataset=Dataset.from_list(rows * batch),
            reward_funcs=lambda completions, **k: [0.0] * len(completions),
            peft_config=lora,
        )
        trainer._generate_single_turn = lambda *a, **k: (replay, None)
    loaded = peak_gib()
    trainer.train()
    return {"loaded_gib": loaded, "peak_gib": peak_gib()}


def available_gib() -> float:
    """The machine's MemAvailable (/proc/meminfo), GiB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    raise SystemExit("/proc/meminfo has no MemAvailable line")


def watched(cmd: list[str], floor: float) -> tuple[dict | None, str]:
    """Run one measuring child; (its RESULT, "") or (None, why it has none). The child is
    killed once the machine has less than `floor` GiB available."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        low = None
        while proc.poll() is None:
            if available_gib() < floor:
                low = available_gib()
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if low is not None:
        return None, f"stopped: the machine had {low:.1f} GiB available (< {floor:g})"
    line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        raise SystemExit(f"{' '.join(cmd[2:])} failed:\n{stderr[-3000:]}")
    return json.loads(line[0].removeprefix("RESULT ")), ""


def for_method(values: list[str], method: str) -> list[int]:
    """The sizes among `values` ("N" for every method, "METHOD=N" for one) that apply to
    `method`."""
    out = []
    for value in values:
        name, _, size = value.rpartition("=")
        if name in ("", method):
            out.append(int(size))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", nargs="+", default=["8"],
                    help="batch sizes: N for every method or METHOD=N (dpo=2 grpo=4)")  # fmt: skip
    ap.add_argument("--trl-max-batch", nargs="+", default=[],
                    help="run TRL only at batches up to this (N or METHOD=N; larger ones do not "
                         "fit)")  # fmt: skip
    ap.add_argument("--floor", type=float, default=4.0,
                    help="kill a child once the machine has less GiB available")  # fmt: skip
    ap.add_argument("--method", nargs="+", default=["dpo", "grpo"], choices=["dpo", "grpo"])
    ap.add_argument("--name", default="memory_vs_trl", help="the table's name in benchmarks.md")
    ap.add_argument("--child", nargs=2, metavar=("METHOD", "SIDE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as tmp:
            result = child(*args.child, args.seq, int(args.batch[0]), Path(tmp))
        print("RESULT " + json.dumps(result))
        return
    smollm2_hf(MODEL_DIR)
    rows = []
    for method in args.method:
        trl_max = max(for_method(args.trl_max_batch, method), default=None)
        for batch in for_method(args.batch, method):
            peaks, why = {}, {}
            for side in ("ours", "trl"):
                if side == "trl" and trl_max is not None and batch > trl_max:
                    peaks[side], why[side] = None, "not measured (too large for this machine)"
                else:
                    cmd = [sys.executable, __file__, "--child", method, side, "--seq",
                           str(args.seq), "--batch", str(batch)]  # fmt: skip
                    peaks[side], why[side] = watched(cmd, args.floor)
                print(method, batch, side, peaks[side] or why[side], flush=True)
            ours_gib = peaks["ours"] and peaks["ours"]["peak_gib"]
            trl_gib = peaks["trl"] and peaks["trl"]["peak_gib"]
            rows.append([method, args.seq, batch,
                         f"{ours_gib:.2f}" if ours_gib else why["ours"],
                         f"{trl_gib:.2f}" if trl_gib else why["trl"],
                         f"{ours_gib / trl_gib:.2f}" if ours_gib and trl_gib else "-"])  # fmt: skip
    from results import record

    record(
        args.name,
        "Peak memory of one post-training step: lmforge vs TRL (SmolLM2-135M)",
        [
            "method",
            "sequence",
            "batch",
            "lmforge peak RSS (GiB)",
            "TRL peak RSS (GiB)",
            "lmforge / TRL",
        ],
        rows,
        notes="Fresh process per side, peak resident set size (ru_maxrss) including the model "
        "load; fp32 LoRA r=8 on the attention projections, activation checkpointing on "
        "both sides, one optimizer step, TRL 1.16. dpo: batch = pairs (2x rows), "
        "reference log-probs computed in the step on both sides; grpo: one prompt of "
        "seq/2 tokens, batch completions of seq/2 tokens replayed to both (no sampling "
        "in the step), beta 0. lmforge never builds the [B, T, V] logits "
        "(lmforge/align/logprobs.py); TRL does. A side 'not measured' was not run (its "
        "step would not fit in this machine's memory beside other jobs); 'stopped' was killed "
        "once the machine's available memory fell below the floor.",
    )


if __name__ == "__main__":
    main()
