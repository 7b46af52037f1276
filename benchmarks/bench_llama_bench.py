"""lmforge against llama.cpp's own `llama-bench` and `llama-perplexity` on the same GGUF files.

Each format is compared with itself: lmforge loads the file with `LM.load` (its default: the
file's own precision, Q8_0 / Q4_0 / Q4_1 blocks in its kernels' layouts, F16 / BF16 weights kept
16-bit) and llama.cpp runs the very same file, so the pairs are matched by construction (Q8_0 with
Q8_0, Q4_1 with Q4_1, BF16 with BF16, ...). llama.cpp is the one vendored in llama-cpp-python
0.3.36, built with its native flags:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build build -j2 --target llama-bench llama-quantize llama-perplexity

Speed (batch 1): prefill = pp128 (a 128-token prompt), decode = tg128 (128 tokens);
llama-bench's own numbers (`-r` repetitions, its mean); lmforge: `LM.generate` (the default
eager engine) on a 128-token prompt, prefill timed as a 1-token generation, decode as the extra
time of 128 more tokens, the median of `--repeats` runs. The runs alternate engine by engine.
Perplexity: llama-perplexity's method on both sides (chunks of `--ctx` tokens, the second half
of each chunk scored) over the first `--chunks` chunks of a text file, tokenised by each engine's
own tokenizer (no BOS: SmolLM2's files do not add one). llama-bench's JSON (CPU, build commit,
backends) is recorded with the table.

    python benchmarks/bench_llama_bench.py --bin build/bin --gguf a.gguf b.gguf --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LMFORGE_SPEED = r"""
import json, sys, time, statistics, torch
path, threads, prompt_len, gen, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
from lmforge.lm import LM
lm = LM.load(path)
prompt = [int(i) for i in torch.randint(100, lm.config.vocab_size - 100, (prompt_len,),
                                        generator=torch.Generator().manual_seed(0))]
run = lambda n: lm.generate([prompt], max_new_tokens=n, temperature=0.0, eos_ids=[])
run(4)  # warm-up
pp, tg = [], []
for _ in range(repeats):
    t = time.perf_counter(); run(1); first = time.perf_counter() - t
    t = time.perf_counter(); run(gen + 1); full = time.perf_counter() - t
    pp.append(prompt_len / first); tg.append(gen / (full - first))
print(json.dumps({"pp": statistics.median(pp), "tg": statistics.median(tg)}))
"""

LMFORGE_PPL = r"""
import json, math, sys, torch
path, text_file, ctx, chunks, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
from lmforge.lm import LM
lm = LM.load(path)
ids = lm.tokenizer.encode(open(text_file, encoding="utf-8").read())
n = min(chunks, len(ids) // ctx)
nll, count = 0.0, 0
with torch.inference_mode():
    for c in range(n):
        x = torch.tensor([ids[c * ctx:(c + 1) * ctx]])
        logp = torch.log_softmax(lm.model(x)[0].float(), -1)
        first = ctx // 2  # llama-perplexity scores the second half of each chunk
        target = x[0, first:]
        nll -= logp[first - 1:ctx - 1].gather(1, target[:, None]).sum().item()
        count += ctx - first
print(json.dumps({"ppl": math.exp(nll / count), "chunks": n, "tokens": count}))
"""


def child(code: str, *args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                         text=True, env=env, check=False)  # fmt: skip
    if out.returncode:
        raise SystemExit(f"lmforge run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_bench(binary: Path, path: Path, threads: int, prompt: int, gen: int, reps: int):
    cmd = [str(binary / "llama-bench"), "-m", str(path), "-p", str(prompt), "-n", str(gen),
           "-t", str(threads), "-r", str(reps), "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return pp["avg_ts"], tg["avg_ts"], pp


def llama_perplexity(binary: Path, path: Path, text: Path, ctx: int, chunks: int, threads: int):
    cmd = [str(binary / "llama-perplexity"), "-m", str(path), "-f", str(text), "-c", str(ctx),
           "--chunks", str(chunks), "-t", str(threads), "-b", str(ctx)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = re.search(r"Final estimate: PPL = ([\d.]+)", out.stdout + out.stderr)
    if not found:
        raise SystemExit(f"llama-perplexity failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return float(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", type=Path, required=True, help="folder with llama-bench etc.")
    p.add_argument("--gguf", type=Path, nargs="+", required=True)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--text", type=Path, default=ROOT / "../shared/data/tinyshakespeare.txt")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--no-ppl", action="store_true")
    p.add_argument("--name", default="llama_bench")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    load = [round(x, 1) for x in os.getloadavg()]
    rows, system = [], None
    for path in args.gguf:
        for threads in args.threads:
            ours, theirs = [], []
            for _ in range(args.repeats):  # alternate: one run of each engine, then again
                ours.append(child(LMFORGE_SPEED, path, threads, args.prompt, args.gen, 1))
                pp, tg, system = llama_bench(args.bin, path, threads, args.prompt, args.gen, 1)
                theirs.append({"pp": pp, "tg": tg})
            med = {k: (statistics.median(r[k] for r in ours), statistics.median(r[k] for r in
                                                                                theirs))
                   for k in ("pp", "tg")}  # fmt: skip
            row = [path.name, threads, round(med["tg"][0], 1), round(med["tg"][1], 1),
                   f"{med['tg'][0] / med['tg'][1]:.2f}x", round(med["pp"][0], 1),
                   round(med["pp"][1], 1), f"{med['pp'][0] / med['pp'][1]:.2f}x"]  # fmt: skip
            if not args.no_ppl and threads == args.threads[-1]:
                text = args.text.resolve()
                mine = child(LMFORGE_PPL, path, text, args.ctx, args.chunks, threads)["ppl"]
                theirs_ppl = llama_perplexity(args.bin, path, text, args.ctx, args.chunks,
                                              threads)  # fmt: skip
                row += [round(mine, 3), round(theirs_ppl, 3), f"{mine / theirs_ppl - 1:+.2%}"]
            else:
                row += ["", "", ""]
            rows.append(row)
            print(row, flush=True)
    keys = ("build_commit", "build_number", "cpu_info", "backends", "type_k", "type_v",
            "flash_attn")  # fmt: skip
    info = {k: system.get(k) for k in keys}
    columns = ["file", "threads", "lmforge decode tok/s", "llama.cpp tg tok/s", "decode ratio",
               "lmforge prefill tok/s", "llama.cpp pp tok/s", "prefill ratio", "lmforge ppl",
               "llama.cpp ppl", "ppl difference"]  # fmt: skip
    notes = (f"Batch 1. Decode: {args.gen} tokens (llama-bench tg{args.gen}; lmforge after a "
             f"{args.prompt}-token prompt), prefill: a {args.prompt}-token prompt (pp"
             f"{args.prompt}); medians of {args.repeats} alternating runs, one per engine in "
             "turn. lmforge: LM.load's default (the file's own precision), eager engine. "
             f"Perplexity: llama-perplexity's method on both sides, {args.chunks} chunks of "
             f"{args.ctx} tokens of {args.text.name}, second half of each chunk scored, at the "
             f"last thread count. llama.cpp: {json.dumps(info)}. Load average at start: "
             f"{load} (2 cores shared with other jobs).")  # fmt: skip
    print(notes)
    if not args.no_record:
        sys.path.insert(0, str(ROOT))
        from benchmarks.results import record

        record(args.name, "lmforge vs llama.cpp's llama-bench on the same GGUF files", columns,
               rows, notes)  # fmt: skip


if __name__ == "__main__":
    main()
