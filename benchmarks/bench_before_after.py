"""Before/after table of one benchmark: two checkouts, the same machine, runs alternating.

Each side runs in its own tree (`--before`, `--after`) with `PYTHONPATH=<tree>`, from that tree's
directory, with that tree's own benchmark script, single-threaded (OMP_NUM_THREADS=1,
MKL_NUM_THREADS=1) under `nice -n 5`: before, after, before, after, ... (`--pairs` pairs), so a
change of the shared host's load hits both sides alike. `uptime` is read at each run's start. The
figures each script prints are parsed from its output; a run whose figure cannot be parsed keeps
its row, saying so. The table (one row per pair and figure, the after / before ratio, and the
median of the pairs) is recorded with `benchmarks/results.py` as
`benchmarks/results/before_after_<bench>.json`, and each run's full output is kept in `--logs`.

Every figure is a throughput (higher is faster), so after / before > 1 means the after tree is
faster. Rows marked "(control)" time code neither tree owns (transformers, TRL): their ratio is
the noise of this host.

    python benchmarks/bench_before_after.py --before /tmp/before --after . --bench generate
    python benchmarks/bench_before_after.py --before /tmp/before --after . --bench dpo --pairs 3

Benchmarks (`--bench`), each run short enough for several pairs:
  generate  bench_generate.py --quick --repeats 3 --threads 1 (batch 1 and 16 with a 64-token
            prompt and 32 new tokens, and a 512-token prompt with 16 new; int8 weights, --dtype
            auto: the script's defaults)
  generate-fp32  the same with --dtype float32 --quantize none (fp32 weights and activations,
            transformers' precision)
  dpo       bench_dpo.py --steps 40 --repeats 1 --threads 1 (its default 4-layer model)
  llamacpp  bench_llamacpp.py --new 64 --reps 1 --threads 1 --batches 1 --only
            'lmforge fp32,lmforge int8' (the lmforge rows and the transformers reference it always
            runs; llama.cpp rows only where llama-cpp-python is installed; SmolLM2 GGUF)
  pretrain  `lmforge pretrain --config configs/shakespeare-char.yaml` for 300 iterations, no
            evaluation but the final one: the lmforge side of bench_pretrain_nanogpt.py (today's
            script runs this command; the old one ran the same Pretrainer in-process), as tokens/s
            and ms per iteration over the whole run (the final evaluation included)
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN_ITERS, PRETRAIN_TOKENS_PER_ITER = 300, 12 * 64  # configs/shakespeare-char.yaml's batch


def _generate(text: str) -> dict[str, float]:
    line = re.compile(
        r"^(batch 1|batch 16|long prompt)\s+B=.*?transformers\s+([\d.]+) tok/s \| "
        r"lmforge\s+([\d.]+) tok/s",
        re.M,
    )
    out = {}
    for case, hf, ours in line.findall(text):
        out[f"lmforge {case} tok/s"] = float(ours)
        out[f"transformers {case} tok/s (control)"] = float(hf)
        # the same run's ratio: load changes within a run hit both engines alike
        out[f"lmforge / transformers, {case}"] = round(float(ours) / float(hf), 3)
    return out


def _dpo(text: str) -> dict[str, float]:
    m = re.search(
        r"median steps/s\s+lmforge ([\d.]+)\s+TRL ([\d.]+)\s+"
        r"\(lmforge with precompute_ref ([\d.]+)\)",
        text,
    )
    if not m:
        return {}
    return {
        "lmforge DPO steps/s": float(m.group(1)),
        "lmforge DPO precompute_ref steps/s": float(m.group(3)),
        "TRL DPO steps/s (control)": float(m.group(2)),
    }


def _llamacpp(text: str) -> dict[str, float]:
    line = re.compile(
        r"^rep 1 1 thr batch 1 (.+?)\s+prefill\s+(\d+) tok/s\s+decode\s+([\d.]+) tok/s", re.M
    )
    out = {}
    for name, prefill, decode in line.findall(text):
        tag = " (control)" if name.startswith("transformers") else ""
        out[f"{name} decode tok/s{tag}"] = float(decode)
        out[f"{name} prefill tok/s{tag}"] = float(prefill)
    return out


def _pretrain(text: str) -> dict[str, float]:
    m = re.search(r"^final: step \d+ .*?([\d,]+) tokens/s", text, re.M)
    if not m:
        return {}
    tps = float(m.group(1).replace(",", ""))
    # iterations per second, so that every figure is "higher is faster"
    return {"pretrain tokens/s": tps, "pretrain iterations/s": tps / PRETRAIN_TOKENS_PER_ITER}


# name -> (arguments after `python`, given the run's scratch folder; parser of the output)
GENERATE_ARGS = ["benchmarks/bench_generate.py", "--quick", "--repeats", "3", "--threads", "1"]
BENCHES: dict[str, tuple[Callable[[Path], list[str]], Callable[[str], dict[str, float]]]] = {
    "generate": (
        lambda _: GENERATE_ARGS,
        _generate,
    ),
    "generate-fp32": (
        lambda _: [*GENERATE_ARGS, "--dtype", "float32", "--quantize", "none"],
        _generate,
    ),
    "dpo": (
        lambda _: ["benchmarks/bench_dpo.py", "--steps", "40", "--repeats", "1", "--threads", "1"],
        _dpo,
    ),
    "llamacpp": (
        lambda scratch: [
            "benchmarks/bench_llamacpp.py",
            "--new",
            "64",
            "--reps",
            "1",
            "--threads",
            "1",
            "--batches",
            "1",
            "--only",
            "lmforge fp32,lmforge int8",
            "--out",
            str(scratch / "llamacpp.json"),
        ],  # fmt: skip
        _llamacpp,
    ),
    "pretrain": (
        lambda scratch: [
            "-m",
            "lmforge.cli.main",
            "pretrain",
            "--config",
            "configs/shakespeare-char.yaml",
            "--max_iters",
            str(PRETRAIN_ITERS),
            "--lr_decay_iters",
            str(PRETRAIN_ITERS),
            "--eval_interval",
            "100000",
            "--log_interval",
            "50",
            "--out_dir",
            str(scratch / "pt"),
        ],  # fmt: skip
        _pretrain,
    ),
}


# what a reader of each table needs to know about how the two sides' scripts differ
BENCH_NOTES = {
    "generate": "Both trees' scripts build the same 32M Llama (seed 0) and time the Engine at "
    "their default precision (int8 weights, --dtype auto: fp32 activations on this CPU); each "
    "figure is the median of the script's 3 alternating repeats within one run.",
    "dpo": "The before tree's script gives TRL a random LlamaForCausalLM of the same shape; "
    "today's loads the very weights lmforge trains: the control's speed does not depend on it.",
    "llamacpp": "lmforge rows only (llama-cpp-python is not installed here); 64 greedy tokens "
    "after a 128-token prompt, batch 1, one rep per run.",
    "pretrain": "Char-level Tiny Shakespeare (4 layers, d_model 128, batch 12 x 64 tokens); "
    "tokens/s is the CLI's final figure (tokens trained / elapsed, the final evaluation "
    "included), iterations/s that over 768 tokens per iteration. Today's "
    "bench_pretrain_nanogpt.py runs this very command to a target val loss against nanoGPT; the "
    "before tree's ran the same Pretrainer in-process for a fixed number of iterations.",
}


def commit(tree: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def load_average(line: str) -> str:
    """'3.71, 3.80, 4.02' from an uptime line."""
    return line.rsplit("load average:", 1)[-1].strip()


def run_once(tree: Path, bench: str, log: Path, timeout: float) -> tuple[dict[str, float], str]:
    """One run of `bench` in `tree`: (its parsed figures, the load at its start); the whole
    output goes to `log`."""
    args_of, parse = BENCHES[bench]
    with tempfile.TemporaryDirectory() as scratch:
        argv = [sys.executable, *args_of(Path(scratch))]
        script = tree / argv[1]
        if script.suffix == ".py" and "--no-record" in script.read_text():
            argv.append("--no-record")  # a full run of today's scripts records its own table
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1"}  # fmt: skip
        env.setdefault("LMFORGE_SHARED_DATA", str(ROOT.parent / "shared" / "data"))
        start = uptime()
        cmd = ["nice", "-n", "5", *argv]
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                                  timeout=timeout)  # fmt: skip
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            text, rc = f"{e.stdout or ''}{e.stderr or ''}\n[timed out after {timeout:.0f} s]", None
    log.write_text(f"$ cd {tree} && {' '.join(cmd)}\n# {start}\n# exit code {rc}\n\n{text}")
    figures = parse(text)
    if not figures:
        print(f"  no figure parsed (exit code {rc}); see {log}", flush=True)
    return figures, start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="the earlier checkout")
    ap.add_argument("--after", default=ROOT, type=Path, help="the later checkout (this one)")
    ap.add_argument("--bench", required=True, choices=sorted(BENCHES))
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--logs", type=Path, default=None, help="folder for each run's output")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run at most")
    ap.add_argument("--no-record", action="store_true", help="print the table only")
    args = ap.parse_args()
    before, after = args.before.resolve(), args.after.resolve()
    logs = args.logs or Path(tempfile.mkdtemp(prefix=f"before_after_{args.bench}_"))
    logs.mkdir(parents=True, exist_ok=True)
    commits = {"before": commit(before), "after": commit(after)}
    print(f"{args.bench}: before {commits['before']} ({before}), after {commits['after']} "
          f"({after}); logs in {logs}", flush=True)  # fmt: skip

    runs: list[dict[str, tuple[dict[str, float], str]]] = []
    for i in range(args.pairs):
        pair = {}
        for side, tree in (("before", before), ("after", after)):
            print(f"pair {i + 1} {side}: {uptime()}", flush=True)
            pair[side] = run_once(tree, args.bench, logs / f"{i + 1}_{side}.log", args.timeout)
            print(f"  {pair[side][0]}", flush=True)
        runs.append(pair)

    names = list(dict.fromkeys(k for p in runs for side in p.values() for k in side[0]))
    rows, ratios = [], {n: [] for n in names}
    for i, pair in enumerate(runs):
        (fb, lb), (fa, la) = pair["before"], pair["after"]
        if not names:
            rows.append([i + 1, "no figure parsed on either side", None, None, None,
                         load_average(lb), load_average(la)])  # fmt: skip
        for n in names:
            b, a = fb.get(n), fa.get(n)
            ratio = a / b if a is not None and b else None
            if ratio is not None:
                ratios[n].append(ratio)
            rows.append([i + 1, n, b if b is not None else "not parsed",
                         a if a is not None else "not parsed",
                         f"{ratio:.3f}" if ratio is not None else "—",
                         load_average(lb), load_average(la)])  # fmt: skip
    for n in names:
        b = [p["before"][0][n] for p in runs if n in p["before"][0]]
        a = [p["after"][0][n] for p in runs if n in p["after"][0]]
        med = f"{statistics.median(ratios[n]):.3f}" if ratios[n] else "—"
        rows.append(["median", n, statistics.median(b) if b else None,
                     statistics.median(a) if a else None, med, "", ""])  # fmt: skip
    columns = ["pair", "figure", "before", "after", "after / before", "load (1, 5, 15 min) "
               "at before's start", "load at after's start"]  # fmt: skip
    width = max(len(str(r[1])) for r in rows)
    for r in rows:
        print(f"{r[0]!s:>6}  {r[1]:<{width}}  {r[2]!s:>12}  {r[3]!s:>12}  {r[4]!s:>6}  "
              f"[{r[5]}] [{r[6]}]")  # fmt: skip
    if args.no_record:
        return
    sys.path.insert(0, str(ROOT))
    from benchmarks.results import record

    args_of, _ = BENCHES[args.bench]
    shown = " ".join(args_of(Path("<scratch>")))
    notes = (
        f"Before: commit {commits['before']}; after: commit {commits['after']}. Each run: "
        f"`cd <tree> && OMP_NUM_THREADS=1 PYTHONPATH=<tree> nice -n 5 python {shown}` (plus "
        "--no-record where the tree's script has it), before and after alternating, "
        f"{args.pairs} pairs, on a shared 2-core host whose load is shown at each run's start. "
        "Figures are throughputs: after / before > 1 is faster after. (control) rows time code "
        "outside lmforge (the same transformers / TRL in both runs): their spread is the noise. "
        + BENCH_NOTES[args.bench]
    )
    title = f"Before/after: {args.bench}, {commits['before']} vs {commits['after']}"
    path = record(f"before_after_{args.bench}", title, columns, rows, notes=notes,
                  command="python " + " ".join(sys.argv))  # fmt: skip
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
