"""GRPO training-step throughput: lmforge's GRPOTrainer vs TRL's GRPOTrainer, same model and data.

Both train the same randomly initialised Llama-shaped model (RMSNorm, RoPE, SwiGLU, no biases;
4 layers, d_model 128), read from one Hugging Face-layout folder so the weights are identical,
on prompts of the built-in 2-digit addition task with the same character tokenizer and the same
binary exact-answer reward: 16 prompts x 8 completions per step,
up to 6 new tokens at temperature 1.0, β = 0 (no reference model), one update per batch. A step
is everything: sampling (lmforge: its KV-cache engine; TRL: transformers' generate), rewards,
advantages, loss, backward, optimizer. Steps/s are measured after warm-up steps, runs alternate,
and the median of `--repeats` is reported (the machine is shared, so only ratios taken in one
process mean anything). TRL is a benchmark-only dependency: `pip install trl`.

  python benchmarks/bench_grpo.py [--steps 10] [--repeats 3] [--threads 1]

`--model smollm2` times the step issue 36 names instead: the real SmolLM2-135M-Instruct (both
sides load one fp32 Hugging Face folder, `trl_common.smollm2_hf`), one prompt x 8 completions of
exactly `--new-tokens` (256) tokens per step (the EOS is ignored on our side, TRL is given
`min_new_tokens`, so both generate and train on the same number of tokens), full fine-tuning,
loss_type dapo, β = 0 (TRL's defaults), activation checkpointing off on both sides. Every step is
split into the rollout (sampling, rewards; of which the generation alone) and the training (the
rest: loss, backward, optimizer), each side's runs alternate, and the table is recorded
(`grpo_speed_smollm2` in docs/benchmarks.md).

  python benchmarks/bench_grpo.py --model smollm2 [--steps 3] [--warmup 1] [--repeats 2]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from trl_common import (
    bench_parser,
    compare,
    hf_twin,
    set_threads,
    smollm2_hf,
    steps_per_second,
    trl_steps_per_second,
)
from trl_trajectory import MODEL_DIR, records, reward_of_text, write_jsonl

from lmforge.align.grpo import GRPOConfig, GRPOTrainer
from lmforge.model.config import ModelConfig
from lmforge.tasks.answers import verify
from lmforge.tasks.synthetic import problems

PROMPTS, G, NEW_TOKENS, WARMUP = 16, 8, 6, 3


def ours(directory: Path, steps: int, out: Path) -> float:
    cfg = GRPOConfig(init=str(directory), out_dir=str(out), data="task:add:2", n_train=2000,
                     n_eval=8, batch_size=PROMPTS, group_size=G, max_new_tokens=NEW_TOKENS,
                     temperature=1.0, beta=0.0, num_iterations=1, max_iters=steps + WARMUP,
                     lr=1e-5, min_lr=1e-5, progress=False)  # fmt: skip
    return steps_per_second(GRPOTrainer(cfg, log=lambda *a: None), steps, WARMUP)


def trl_run(directory: Path, cfg: ModelConfig, steps: int, out: Path) -> float:
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    hf_tok, model = hf_twin(directory, cfg)
    rows = problems("add", 2000, seed=1337, digits=2)
    data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def exact_match(completions, answer, **kw) -> list[float]:
        return [verify({"answer": a}, c) for c, a in zip(completions, answer)]

    args = TRLConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS * G,
                     num_generations=G, max_completion_length=NEW_TOKENS, temperature=1.0,
                     beta=0.0, num_iterations=1, max_steps=steps + WARMUP, learning_rate=1e-5,
                     report_to="none", use_cpu=True, save_strategy="no", logging_steps=10_000,
                     dataloader_num_workers=0, disable_tqdm=True)  # fmt: skip
    return trl_steps_per_second(
        lambda callbacks: TRLTrainer(model=model, reward_funcs=exact_match, args=args,
                                     train_dataset=data, processing_class=hf_tok,
                                     callbacks=callbacks),
        steps, WARMUP)  # fmt: skip


# ----------------------------------------------------------------------------- SmolLM2 step

SMOL_GROUP, SMOL_LR = 8, 1e-6


class PhaseClock:
    """Seconds spent inside wrapped functions, per phase, since the last `take()`."""

    def __init__(self):
        self.spent: dict[str, float] = {}

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[phase] = self.spent.get(phase, 0.0) + time.perf_counter() - t0

        return timed

    def take(self) -> dict[str, float]:
        spent, self.spent = self.spent, {}
        return spent


def smol_ours(data: Path, eval_data: Path, out: Path, args) -> list[dict[str, float]]:
    """lmforge's GRPO steps on SmolLM2: per timed step, its wall time, rollout and generation
    seconds and mean completion length."""
    cfg = GRPOConfig(init=str(MODEL_DIR), out_dir=str(out), data=str(data),
                     eval_data=str(eval_data), n_train=64, n_eval=1, batch_size=1,
                     group_size=SMOL_GROUP, max_new_tokens=args.new_tokens, temperature=1.0,
                     beta=0.0, loss_type="dapo", num_iterations=1,
                     max_iters=args.warmup + args.steps, lr=SMOL_LR, min_lr=SMOL_LR,
                     warmup_iters=0, weight_decay=0.0, grad_clip=1.0, progress=False,
                     threads=args.threads, eval_interval=10**6, log_interval=10**6,
                     seed=1234)  # fmt: skip
    trainer = GRPOTrainer(cfg, log=lambda *a: None,
                          reward=lambda r, c: reward_of_text(r["answer"], c))  # fmt: skip
    trainer.engine.stop_ids = []  # no early stop: every completion is exactly new_tokens long
    clock = PhaseClock()
    trainer.engine.generate = clock.wrap("generate", trainer.engine.generate)
    trainer.next_batch = clock.wrap("rollout", trainer.next_batch)
    steps = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        stats = trainer.train_step()
        wall = time.perf_counter() - t0
        if i >= args.warmup:
            steps.append({"wall": wall, **clock.take(), "length": stats["length"]})
        clock.take()
    return steps


def smol_trl(rows: list[dict], out: Path, args) -> list[dict[str, float]]:
    """TRL's GRPOTrainer on the same weights and prompts; the same per-step figures (a step's
    wall time runs from the end of the previous step to the end of this one)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer

    hf_tok, model = hf_twin(MODEL_DIR)

    def reward(prompts, completions, answer, **kw) -> list[float]:
        return [reward_of_text(a, c) for a, c in zip(answer, completions)]

    targs = TRLConfig(output_dir=str(out), per_device_train_batch_size=SMOL_GROUP,
                      num_generations=SMOL_GROUP, max_completion_length=args.new_tokens,
                      generation_kwargs={"min_new_tokens": args.new_tokens}, temperature=1.0,
                      beta=0.0, loss_type="dapo", num_iterations=1,
                      max_steps=args.warmup + args.steps, learning_rate=SMOL_LR,
                      lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                      max_grad_norm=1.0, report_to="none", use_cpu=True, save_strategy="no",
                      logging_steps=1, dataloader_num_workers=0, disable_tqdm=True, seed=1234,
                      bf16=False, fp16=False,  # TRL's configs default to bf16 autocast
                      gradient_checkpointing=False)  # fmt: skip
    clock = PhaseClock()
    stamps: list[float] = []
    phases: list[dict[str, float]] = []
    lengths: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, train_args, state, control, **kw):
            stamps.append(time.perf_counter())
            phases.append(clock.take())

        def on_log(self, train_args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    trainer = TRLTrainer(model=model, reward_funcs=reward, args=targs,
                         train_dataset=Dataset.from_list(rows), processing_class=hf_tok,
                         callbacks=[Clock()])  # fmt: skip
    trainer._generate_single_turn = clock.wrap("generate", trainer._generate_single_turn)
    trainer._generate_and_score_completions = clock.wrap(
        "rollout", trainer._generate_and_score_completions
    )
    trainer.train()
    return [{"wall": stamps[i] - stamps[i - 1], **phases[i], "length": lengths[i]}
            for i in range(max(args.warmup, 1), len(stamps))]  # fmt: skip


def smollm2(args) -> None:
    """Alternate lmforge's and TRL's GRPO steps on SmolLM2; print and record the split."""
    from results import record

    smollm2_hf(MODEL_DIR)
    load_start = os.getloadavg()[0]
    rows = records("grpo", 64)
    runs: dict[str, list[dict[str, float]]] = {"lmforge": [], "TRL": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = write_jsonl(tmp / "train.jsonl", rows)
        eval_data = write_jsonl(tmp / "eval.jsonl", rows[:1])
        for i in range(args.repeats):
            runs["lmforge"] += smol_ours(data, eval_data, tmp / f"ours{i}", args)
            runs["TRL"] += smol_trl(rows, tmp / f"trl{i}", args)
            for side, steps in runs.items():
                last = steps[-args.steps :]
                print(f"repeat {i + 1} {side}: " + ", ".join(
                    f"{s['wall']:.1f} s (rollout {s['rollout']:.1f}, generate "
                    f"{s['generate']:.1f}, {s['length']:.0f} tokens)" for s in last))  # fmt: skip
    table, medians = [], {}
    for side, steps in runs.items():
        med = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
        train = statistics.median(s["wall"] - s["rollout"] for s in steps)
        medians[side] = med["wall"]
        per_token = 1000 * med["generate"] / (SMOL_GROUP * med["length"])
        table.append([side, len(steps), f"{med['wall']:.1f}", f"{med['rollout']:.1f}",
                      f"{med['generate']:.1f}", f"{per_token:.1f}", f"{train:.1f}",
                      f"{med['length']:.0f}"])  # fmt: skip
    ratio = medians["lmforge"] / medians["TRL"]
    per_repeat = [  # each repeat's median step, lmforge's over TRL's: the spread under the load
        statistics.median(s["wall"] for s in runs["lmforge"][i * args.steps : (i + 1) * args.steps])
        / statistics.median(s["wall"] for s in runs["TRL"][i * args.steps : (i + 1) * args.steps])
        for i in range(args.repeats)
    ]
    print("per repeat: " + ", ".join(f"{r:.2f}" for r in per_repeat))
    for row in table:
        row.append(f"{medians[row[0]] / medians['TRL']:.2f}")
        print(row)
    print(f"lmforge / TRL wall time per step: {ratio:.2f}")
    record("grpo_speed_smollm2", "GRPO step on SmolLM2-135M-Instruct: lmforge vs TRL (fp32, CPU)",
           ["side", "timed steps", "step s", "rollout s", "generation s",
            "generation ms / generated token", "training s", "completion tokens", "step / TRL's"],
           table,
           notes=f"One GRPO step = 1 prompt x {SMOL_GROUP} completions of exactly "
                 f"{args.new_tokens} new tokens (EOS ignored on lmforge's side, min_new_tokens "
                 "on TRL's), temperature 1, full fine-tuning in fp32, AdamW lr 1e-6, "
                 "loss_type dapo, beta 0, one update per batch, activation checkpointing off "
                 "on both sides; both load the same SmolLM2 weights (trl_common.smollm2_hf). "
                 "Rollout = sampling + rewards (lmforge: next_batch; TRL: "
                 "_generate_and_score_completions), of which generation = the sampler alone "
                 "(lmforge's KV-cache engine; TRL: transformers' generate); training = step - "
                 "rollout (loss, backward, optimizer). Medians over the timed steps of "
                 f"{args.repeats} alternating runs per side ({args.warmup} warm-up step each), "
                 f"{args.threads} thread(s), TRL 1.16. Per repeat, lmforge's median step over "
                 f"TRL's: {', '.join(f'{r:.2f}' for r in per_repeat)}. Host load average "
                 f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
           command=f"python benchmarks/bench_grpo.py --model smollm2 --steps {args.steps} "
                   f"--warmup {args.warmup} --repeats {args.repeats} --new-tokens "
                   f"{args.new_tokens}")  # fmt: skip


def main() -> None:
    ap = bench_parser("lmforge GRPO vs TRL GRPO step throughput", 10)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                    help="tiny: random 4-layer model, steps/s; smollm2: the real model, "
                         "seconds per step split into rollout and training")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=1, help="smollm2: untimed steps per run")
    ap.add_argument("--new-tokens", type=int, default=256, help="smollm2: tokens per completion")
    args = set_threads(ap.parse_args())
    if args.model == "smollm2":
        smollm2(args)
        return
    med = compare("lmforge GRPO vs TRL GRPO step throughput", 10, trl_run, {"ours": ours},
                  ("ours", "trl"), digits=3, args=args)  # fmt: skip
    print(f"\nmedian steps/s  lmforge {med['ours']:.3f}  TRL {med['trl']:.3f}")
    print(f"speed-up vs TRL: {med['ours'] / med['trl']:.2f}x")


if __name__ == "__main__":
    main()
