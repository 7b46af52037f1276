"""lmforge against llama.cpp's own tools on the same GGUF files: speed at batch 1 / 8 / 16,
perplexity on the same tokens, peak memory and load time.

Each format is compared with itself: lmforge loads the file with `LM.load` (its default: the
file's own precision, Q8_0 / Q4_0 / Q4_1 blocks in its kernels' layouts, F16 / BF16 weights kept
16-bit) and llama.cpp runs the very same file, so the pairs are matched by construction (Q8_0 with
Q8_0, Q4_1 with Q4_1, BF16 with BF16, ...). llama.cpp is the one vendored in llama-cpp-python
0.3.36, built with its native flags:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF
    cmake --build build -j2 --target llama-bench llama-batched-bench llama-perplexity \\
        llama-tokenize

An AVX2-only CPU can be emulated on an AVX-512 one: llama.cpp built with -DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF, and lmforge run with
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 LMFORGE_KERNEL_VARIANT=avx2 (recorded in the
notes): the same code paths as on a Zen 3, on this CPU's caches and memory.

lmforge runs two engines: eager (`EngineConfig(compile=False)`, what `LM.generate` and
`lmforge generate` use) and compiled (`compile=True`, the default of `lmforge chat` / `serve`
where a C++ compiler exists: the decode step exported and AOT-compiled, kept in the compile
cache, so only the first run compiles: the first generation at each batch size compiles or loads
the steps it needs, and its time is in the second table).

Speed: `--prompt`-token random prompts, then `--gen` tokens (greedy, no EOS). Batch 1: llama.cpp's
`llama-bench` pp / tg; lmforge's Engine (max_batch 1, as `lmforge chat`), prefill timed as a
1-token generation, decode as the extra time of `--gen` more tokens. Batch 8 / 16: llama.cpp's
`llama-batched-bench` (B prompts decoded as one batch, then B tokens per step: S_PP = B x prompt /
prefill time, S_TG = B x gen / decode time); lmforge's Engine (max_batch 16) with B prompts,
counted the same way (aggregate tokens of all rows per second). One process per engine and
repeat, the engines alternating; medians over `--repeats`. Threads: `-t N` for llama.cpp,
`torch.set_num_threads(N)` and OMP_NUM_THREADS=N for lmforge.

Perplexity: llama-perplexity's method on both sides (llama.cpp's tools/perplexity/perplexity.cpp,
`perplexity()`): the file tokenised whole (one trailing newline dropped, as its `-f` does; no
escape processing: `--no-escape`), chunks of `--ctx` tokens, BOS in place of each chunk's first
token when the vocabulary adds one, and of each chunk the tokens after its first half scored:
logits at positions ctx/2 .. ctx-2 predict tokens ctx/2+1 .. ctx-1 (ctx/2 - 1 tokens per chunk).
With `llama-tokenize` in `--bin` both tokenisations of the scored tokens are compared.

Memory and load: peak RSS of the whole process (its `ru_maxrss`, from wait4) running batch 1 then
8 and 16 (KV cache for 16 sequences of prompt + gen tokens on both sides: llama-batched-bench's
-c 16 x (prompt + gen)); lmforge's load time is `LM.load`'s wall time (file to model, torch and
the native kernels already imported), llama.cpp's is its own `load time` (llama_perf_context:
model load to the end of the first decode, a 16-token warm-up in llama-batched-bench).

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
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what narrows lmforge's instruction sets: torch's kernels and Inductor's vector ISA, oneDNN,
# lmforge's native kernel variant (cpu_kernels.pick_variant); recorded in the notes when set
ISA_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "LMFORGE_KERNEL_VARIANT")
BATCHES = (1, 8, 16)
# a speed row's measurements (bench_half_weights.py's too)
SPEED_COLUMNS = ["eager decode tok/s", "compiled decode tok/s", "llama.cpp decode tok/s",
                 "compiled / llama.cpp", "eager / llama.cpp", "eager prefill tok/s",
                 "compiled prefill tok/s", "llama.cpp prefill tok/s",
                 "best prefill / llama.cpp"]  # fmt: skip

LMFORGE_SPEED = r"""
import json, os, sys, time, torch
path, mode, threads, prompt_len, gen = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
batches, cache_dir = [int(b) for b in sys.argv[6].split(",")], sys.argv[7]
torch.set_num_threads(threads)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, "inductor"))
from lmforge.lm import LM
from lmforge.infer.engine import Engine
from lmforge.infer.params import GenerationParams
from lmforge.infer.cpu_kernels import native_kernels
import lmforge.interop.gguf_load, lmforge.interop.gguf_tokenizer  # imported before timing
native_kernels()

def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

out = {"before": rss("VmRSS")}
start = time.perf_counter()
lm = LM.load(path)
out["load_s"] = time.perf_counter() - start
gen_ = torch.Generator().manual_seed(0)
compiled = mode == "compiled"

def engine(rows):
    made = Engine.from_lm(lm, max_batch=rows, max_len=prompt_len + gen + 8, compile=compiled,
                          eos_ids=[])
    if hasattr(made.decode_step, "use_cache_dir"):  # the exported step: chat's compile cache
        made.decode_step.use_cache_dir(cache_dir)
    kv = sum(t.numel() * t.element_size() for t in (*made.cache.k, *made.cache.v))
    out["kv"] = max(out.get("kv", 0), kv)  # the largest engine's KV cache, in bytes
    return made

def speed(eng, rows):
    prompts = [[int(i) for i in torch.randint(100, lm.config.vocab_size - 100, (prompt_len,),
                                              generator=gen_)] for _ in range(rows)]
    run = lambda n: eng.generate(prompts, GenerationParams(n, temperature=0.0, stop_token_ids=[]))
    counts = dict(getattr(eng.decode_step, "counts", {}))
    t = time.perf_counter(); run(4); warm = time.perf_counter() - t  # compiles what it needs
    if compiled:  # steps compiled / loaded from the cache by this warm-up, and its time
        now = eng.decode_step.counts
        out.setdefault("warm_up", []).append([rows, warm, {k: now[k] - counts[k] for k in now}])
    t = time.perf_counter(); run(1); first = time.perf_counter() - t
    t = time.perf_counter(); done = run(gen + 1); full = time.perf_counter() - t
    out[f"tokens{rows}"] = [list(o.token_ids[:16]) for o in done]  # compared across engines
    out[f"pp{rows}"], out[f"tg{rows}"] = rows * prompt_len / first, rows * gen / (full - first)

if 1 in batches:
    speed(engine(1), 1)
if [b for b in batches if b > 1]:
    eng = engine(max(batches))
    for rows in batches:
        if rows > 1:
            speed(eng, rows)
out["peak"] = rss("VmHWM")  # exact: this process alone
print(json.dumps(out))
"""

LMFORGE_PPL = r"""
import json, math, sys, torch
path, text_file, ctx, chunks, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
torch.set_num_threads(threads)
from lmforge.lm import LM
lm = LM.load(path)
text = open(text_file, encoding="utf-8").read()
bos = lm.tokenizer.backend.encode("").ids[:1]  # [BOS] where the file's vocabulary adds one
ids = bos + lm.tokenizer.encode(text[:-1] if text.endswith("\n") else text)  # as llama's -f
n, first = min(chunks, len(ids) // ctx), ctx // 2
nll, count = 0.0, 0
with torch.inference_mode():
    for c in range(n):
        x = torch.tensor([bos + ids[c * ctx + len(bos):(c + 1) * ctx]])  # BOS first, as llama's
        logp = torch.log_softmax(lm.model(x)[0].float(), -1)
        nll -= logp[first:ctx - 1].gather(1, x[0, first + 1:, None]).sum().item()
        count += ctx - 1 - first
print(json.dumps({"ppl": math.exp(nll / count), "chunks": n, "tokens": count,
                  "ids": ids[:n * ctx]}))
"""


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[str, int]:
    """Run cmd; returns (stdout + stderr, its peak RSS in bytes: wait4's ru_maxrss, in KiB on
    Linux). Linux keeps the high-water mark across fork and exec, so that is the larger of the
    command's own peak and this process's RSS when it forked: this script stays at tens of MiB,
    far below either engine's. A failure is one line naming the command, then its output."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read().decode(errors="replace")
    if proc.returncode:
        raise SystemExit(f"{Path(cmd[0]).name} failed ({proc.returncode}):\n{text[-3000:]}")
    return text, usage.ru_maxrss * 1024


def child(code: str, threads: int, *args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    text, peak = run_measured([sys.executable, "-c", code, *map(str, args)], env)
    return {"peak": peak, **json.loads(text.strip().splitlines()[-1])}


def parse_llama_bench(text: str) -> tuple[float, float, dict]:
    """llama-bench -o json's output -> (pp tok/s, tg tok/s, the pp row: system info)."""
    lines = text.splitlines()  # the JSON array: from a line "[" to the last line "]"
    rows = json.loads("\n".join(lines[lines.index("[") : len(lines) - lines[::-1].index("]")]))
    pp = next(r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
    return pp["avg_ts"], tg["avg_ts"], pp


def parse_batched_bench(text: str) -> dict[int, tuple[float, float]]:
    """llama-batched-bench --output-format jsonl's lines -> {sequences: (S_PP, S_TG) tok/s}."""
    rows = [json.loads(line) for line in text.splitlines() if line.startswith('{"n_kv_max"')]
    return {r["pl"]: (r["speed_pp"], r["speed_tg"]) for r in rows}


def parse_load_ms(text: str) -> float:
    """llama_perf_context_print's `load time = X ms`."""
    return float(re.search(r"load time =\s*([\d.]+) ms", text).group(1))


def parse_perplexity(text: str) -> tuple[float, str]:
    """llama-perplexity's output -> (its final PPL, its system_info line: CPU features)."""
    found = re.search(r"Final estimate: PPL = ([\d.]+)", text)
    if not found:
        raise SystemExit(f"llama-perplexity printed no estimate:\n{text[-3000:]}")
    info = re.search(r"system_info: (.*)", text)
    return float(found.group(1)), info.group(1).strip(" |") if info else ""


def llama_speed(binary: Path, path: Path, threads: int, prompt: int, gen: int) -> dict:
    """Batch 1 from llama-bench, 8 / 16 from llama-batched-bench (whose process gives the peak
    RSS and load time)."""
    cmd = [str(binary / "llama-bench"), "-m", str(path), "-p", str(prompt), "-n", str(gen),
           "-t", str(threads), "-r", "1", "-o", "json"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # ggml's OpenMP pool: -t threads
    text, _ = run_measured(cmd, env)
    pp, tg, system = parse_llama_bench(text)
    ctx = max(BATCHES) * (prompt + gen)
    cmd = [str(binary / "llama-batched-bench"), "-m", str(path), "-c", str(ctx), "-b", "2048",
           "-ub", "512", "-npp", str(prompt), "-ntg", str(gen), "-t", str(threads),
           "-npl", ",".join(map(str, BATCHES)), "--output-format", "jsonl", "-lv", "4"]  # fmt: skip
    text, peak = run_measured(cmd, env)
    out = {"pp1": pp, "tg1": tg, "system": system, "peak": peak}
    out["load_s"] = parse_load_ms(text) / 1e3
    for rows, (spp, stg) in parse_batched_bench(text).items():
        if rows > 1:
            out[f"pp{rows}"], out[f"tg{rows}"] = spp, stg
        else:
            out["batched_tg1"] = stg  # llama-bench's tg at batch 1, cross-checked
    return out


def perplexity(binary: Path, path: Path, text: Path, ctx: int, chunks: int, threads: int):
    """(lmforge's ppl, llama.cpp's, llama.cpp's system_info, whether llama-tokenize gives the
    same scored tokens: None when it is not built)."""
    ours = child(LMFORGE_PPL, threads, path, text, ctx, chunks, threads)
    out, _ = run_measured([str(binary / "llama-perplexity"), "-m", str(path), "-f", str(text),
                           "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks), "-t",
                           str(threads), "--no-escape"])  # fmt: skip
    same = None
    if (binary / "llama-tokenize").exists():
        ids, _ = run_measured([str(binary / "llama-tokenize"), "-m", str(path), "-f", str(text),
                               "--ids", "--no-escape", "--log-disable"])  # fmt: skip
        theirs = json.loads(ids.strip().splitlines()[-1])
        same = theirs[: len(ours["ids"])] == ours["ids"]
    return ours["ppl"], *parse_perplexity(out), same


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def warm_up_text(runs: list[dict]) -> str:
    """The compiled engine's warm-ups (the first generation at each batch size) of each run,
    e.g. 'b1 80.0 s (1 compiled), b8 95.1 s (1 compiled), b16 0.9 s | b1 2.0 s (1 loaded) ...'."""

    def one(rows, seconds, counts):
        done = ", ".join(f"{n} {how}" for how, n in counts.items() if n)
        return f"b{rows} {seconds:.1f} s" + (f" ({done})" if done else "")

    return " | ".join(", ".join(one(*w) for w in run["warm_up"]) for run in runs)


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
    p.add_argument("--cache", default="~/.cache/lmforge/compile", help="compile cache (as chat's)")
    p.add_argument("--name", default="llama_bench")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args()
    load_start = [round(x, 1) for x in os.getloadavg()]
    cache = str(Path(args.cache).expanduser())
    speed_rows, file_rows, ppl, llama_info = [], [], {}, {}
    for threads in args.threads:  # all files at one thread count, then the next
        for path in args.gguf:
            if not args.no_ppl and path not in ppl:
                ppl[path] = perplexity(args.bin, path, args.text.resolve(), args.ctx,
                                       args.chunks, max(args.threads))  # fmt: skip
                llama_info["system_info"] = ppl[path][2]
            runs = {"eager": [], "compiled": [], "llama.cpp": []}
            for _ in range(args.repeats):  # alternate: one run of each engine, then again
                for mode in ("eager", "compiled"):
                    runs[mode].append(child(LMFORGE_SPEED, threads, path, mode, threads,
                                            args.prompt, args.gen, ",".join(map(str, BATCHES)),
                                            cache))  # fmt: skip
                runs["llama.cpp"].append(llama_speed(args.bin, path, threads, args.prompt,
                                                     args.gen))  # fmt: skip
            llama_info.update(runs["llama.cpp"][0]["system"])
            eager, comp, llama = runs.values()
            for rows in BATCHES:
                tg = [round(median(r, f"tg{rows}"), 1) for r in (eager, comp, llama)]
                pp = [round(median(r, f"pp{rows}"), 1) for r in (eager, comp, llama)]
                same = [a == b for e, c in zip(eager, comp)
                        for a, b in zip(e[f"tokens{rows}"], c[f"tokens{rows}"])]  # fmt: skip
                speed_rows.append([path.name, threads, rows, *tg, f"{tg[1] / tg[2]:.2f}x",
                                   f"{tg[0] / tg[2]:.2f}x", *pp, f"{max(pp[:2]) / pp[2]:.2f}x",
                                   f"{sum(same)}/{len(same)}"])  # fmt: skip
                print(speed_rows[-1], flush=True)
            mib = 2**20
            row = [path.name, threads, *(round(median(r, "peak") / mib) for r in runs.values()),
                   round(median(eager, "before") / mib), round(median(eager, "load_s"), 2),
                   round(median(llama, "load_s"), 2), memory_goal(path, eager, comp),
                   warm_up_text(comp),
                   round(median(llama, "batched_tg1"), 1)]  # fmt: skip
            if path in ppl and threads == args.threads[0]:
                ours, theirs, _, same = ppl[path]
                row += [round(ours, 3), round(theirs, 3), f"{ours / theirs - 1:+.2%}",
                        {None: "not checked", True: "yes", False: "NO"}[same]]  # fmt: skip
            else:
                row += ["", "", "", ""]
            file_rows.append(row)
            print(row, flush=True)
            if not args.no_record:  # after every file: a cut-short run keeps what it measured
                save(args, speed_rows, file_rows, llama_info, load_start)


def memory_goal(path: Path, eager: list[dict], compiled: list[dict]) -> str:
    """Each engine's peak RSS growth over the memory goal's bound, 1.3 x file + KV cache (<= 1
    meets it), medians of the runs."""
    bound = [1.3 * path.stat().st_size + median(r, "kv") for r in (eager, compiled)]
    growth = [median(r, "peak") - median(r, "before") for r in (eager, compiled)]
    return ", ".join(f"{g / b:.2f}" for g, b in zip(growth, bound))


def save(args, speed_rows: list, file_rows: list, llama_info: dict, load_start: list) -> None:
    """Record both tables (benchmarks/results.py) with what both sides ran with."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.results import record

    load_now = [round(x, 1) for x in os.getloadavg()]
    keys = ("build_commit", "build_number", "cpu_info", "backends", "type_k", "type_v",
            "flash_attn", "system_info")  # fmt: skip
    info = json.dumps({k: llama_info.get(k) for k in keys})
    # an instruction set narrowed on purpose (e.g. an AVX2-only CPU emulated on an AVX-512 one)
    isa = {k: os.environ[k] for k in ISA_ENV if k in os.environ}
    narrowed = f" lmforge's instruction set narrowed by {json.dumps(isa)}." if isa else ""
    common = (f"Medians of {args.repeats} alternating runs (eager, compiled, llama.cpp in "
              f"turn), each a fresh process. llama.cpp: {info}. Load average at start "
              f"{load_start}, at this table's last row {load_now} (2 cores shared with other "
              f"jobs).{narrowed}")  # fmt: skip
    speed_cols = ["file", "threads", "batch", *SPEED_COLUMNS, "rows compiled = eager"]
    speed_notes = (f"{args.prompt}-token random prompts, then {args.gen} greedy tokens, EOS "
                   "off. Batch 1: llama-bench pp/tg; lmforge Engine (max_batch 1). Batch 8 / "
                   "16: llama-batched-bench (-npp/-ntg as above, -npl 1,8,16); lmforge Engine "
                   "(max_batch 16). Decode and prefill are aggregate tokens per second over "
                   "all rows on both sides. lmforge: LM.load's default precision (the file's "
                   "own); eager = EngineConfig(compile=False), compiled = compile=True (the "
                   "decode step AOT-compiled; prefill is eager in both). Rows compiled = "
                   "eager: rows whose first 16 greedy tokens the two engines agree on (the "
                   "compiled quantised step keeps an fp16 KV cache: near-ties may flip). "
                   + common)  # fmt: skip
    file_cols = ["file", "threads", "eager peak RSS MiB", "compiled peak RSS MiB",
                 "llama.cpp peak RSS MiB", "lmforge RSS before load MiB", "lmforge load s",
                 "llama.cpp load s", "RSS growth / (1.3 x file + KV): eager, compiled",
                 "compiled engine warm-up", "llama-batched-bench tg at batch 1",
                 "lmforge ppl", "llama.cpp ppl", "ppl difference", "same tokens"]  # fmt: skip
    file_notes = (
        "Peak RSS: the whole process's ru_maxrss running batch 1, 8 and 16 (KV cache for 16 x "
        f"{args.prompt + args.gen} tokens on both sides; lmforge's includes torch, whose "
        "resident size before LM.load is given). Load: lmforge LM.load wall time; llama.cpp its "
        "llama_perf 'load time' (model load to the end of its first decode). RSS growth: peak "
        "minus the RSS before LM.load, over 1.3 x the file's size plus the largest engine's KV "
        "cache (issue 35's memory goal: at most 1). Compiled engine "
        "warm-up: per run, the first generation (4 tokens) at batch 1 (max_batch 1 engine), 8 "
        "and 16 (max_batch 16 engine), with the decode steps it compiled or loaded from the "
        "compile cache (steps for a range of batch sizes). "
        f"Perplexity (at {max(args.threads)} thread(s)): "
        f"llama-perplexity's method on both sides, {args.chunks} chunks of {args.ctx} tokens "
        f"of {args.text.name}, tokens {args.ctx // 2 + 1}..{args.ctx - 1} (from 0) of each "
        "scored; same tokens: llama-tokenize's ids equal lmforge's over the scored chunks. "
        + common
    )
    title = "lmforge vs llama.cpp on the same GGUF files"
    if isa:
        title += f" ({isa.get('ATEN_CPU_CAPABILITY', 'narrowed').upper()} code paths)"
    record(args.name, f"{title}: decode and prefill", speed_cols, speed_rows, speed_notes)
    record(f"{args.name}_memory", f"{title}: memory, load time, perplexity", file_cols,
           file_rows, file_notes)  # fmt: skip


if __name__ == "__main__":
    main()
