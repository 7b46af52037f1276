"""Greedy generation speed: lmforge's Engine vs transformers' `generate`, same weights, one process.

A 32M-parameter Llama (vocab 8192, d_model 512, 8 layers, 8 heads, 4 KV heads, d_ff 1376) is
created with transformers (random init, fp32), saved, and loaded with `LM.load`. Each case runs
both sides alternately, 3 times, and reports the median tokens/s and the ratio. transformers runs
in fp32; lmforge in the precision asked for (default: int8 weights, --dtype auto, see
lmforge/infer/quantize.py: on a CPU fp32 activations with lmforge's own int8 GEMV where it
builds); the script prints both. Same precision: it checks the greedy tokens
are identical. Reduced precision: it reports how many greedy tokens agree with fp32 transformers
(positions, and the first divergence), and once, teacher-forced on one sequence, the top-1
agreement and the logit error against fp32. Batch 1 is compared with the memory-bandwidth bound:
a decoding step reads every weight it uses once, so tokens/s <= bandwidth / bytes read per token
(lmforge's weights at the precision used, all but the embedding table, of which a token reads one
row); bandwidth is measured here by copying a 1 GiB tensor, next to each batch-1 run. It also
times the weight matmuls alone (one GEMV per Linear), the kernels' own ceiling: what separates
batch 1 from it is the per-token work outside the matmuls (norms, RoPE, attention, sampling,
Python), which `--compile` (on CPU: the decode step exported and compiled ahead of time by
AOTInductor, infer/steps.py ExportedStep) cuts. fp32 GEMVs read 4x the bytes of int8. The last
line says which targets this mode met. `--device cuda` runs both sides on a GPU in --dtype
(lmforge replays its decode step as a CUDA graph). A full run (not --quick) records its table
(benchmarks/results/generate_<device>_<quantize>_<dtype>[_compiled][_<n>threads].json,
docs/benchmarks.md).

    python benchmarks/bench_generate.py                                  # int8 weights, bf16
    python benchmarks/bench_generate.py --dtype float32 --quantize none  # same precision as HF
    python benchmarks/bench_generate.py --threads 1 --compile            # the compiled CPU step
    python benchmarks/bench_generate.py --device cuda --quantize none    # on a GPU
    python benchmarks/bench_generate.py --quick                          # short, to check it runs

Threads: torch reads OMP_NUM_THREADS / MKL_NUM_THREADS (set both), or pass --threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

TARGETS = {"batch 1": 2.5, "batch 16": 3.0, "long prompt": 1.5}  # issue 35: batch 16 >= 3x
VERDICTS: dict[str, bool] = {}  # target -> met, for the summary line
ROWS: list[list] = []  # one per compare(), for record()
COLUMNS = ["case", "batch", "prompt", "new tokens", "transformers tok/s", "lmforge tok/s",
           "lmforge / transformers", "same, in CPU time", "greedy agreement"]  # fmt: skip
DEVICE = "cpu"  # --device


def make_checkpoint(directory: str, **shape) -> None:
    """A transformers LlamaForCausalLM with random weights (seed 0, fp32) saved to `directory`:
    the 32M bench model, or another size given as LlamaConfig fields in `shape`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{
        "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32",
        **shape,
    })  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bandwidth_gbs(mib: int = 1024, device: str = "cpu") -> float:
    """Best of 5 copies of a `mib`-MiB tensor, counting the read and the write."""
    src = torch.ones(mib * 2**18, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def matmul_ceiling(model, dtype: torch.dtype, seconds: float = 1.0, device: str = "cpu") -> float:
    """Steps/s of a batch-1 step that were only its weight matmuls (every Linear / quantised
    Linear once on one row of `dtype` activations): how far the GEMV kernels alone can go."""
    from torch import nn

    from lmforge.infer.quantized_linear import QuantizedLinear

    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantizedLinear))]
    calls = [(m.matmul if isinstance(m, QuantizedLinear) else m,
              torch.randn(1, m.in_features, device=device).to(dtype)) for m in layers]  # fmt: skip
    with torch.inference_mode():
        for f, x in calls:
            f(x)
        sync(device)
        steps, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            for _ in range(10):
                for f, x in calls:
                    f(x)
            sync(device)
            steps += 10
        return steps / (time.perf_counter() - t)


def run_hf(model, prompts: torch.Tensor, new: int) -> list[list[int]]:
    prompts = prompts.to(model.device)
    with torch.inference_mode():
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
            min_new_tokens=new, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[:, prompts.shape[1] :].tolist()


def run_ours(engine, prompts: torch.Tensor, new: int) -> list[list[int]]:
    from lmforge.infer.engine import GenerationParams

    params = GenerationParams(max_new_tokens=new, temperature=0.0, stop_token_ids=[])
    return [c.token_ids for c in engine.generate(prompts.tolist(), params)]


def timed(fn, *args) -> tuple[float, float, list]:
    """Wall seconds, this process's CPU seconds (every thread) and fn's result. On a shared
    host the CPU time is what the load leaves alone: a run that waits for a core counts the
    wait in its wall time only."""
    t, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return time.perf_counter() - t, time.process_time() - cpu, out


def agreement(ours: list[list[int]], ref: list[list[int]]) -> str:
    """'identical', or the share of equal positions and the earliest first divergence."""
    if ours == ref:
        return "tokens identical"
    pairs = [(a, b) for o, r in zip(ours, ref) for a, b in zip(o, r)]
    firsts = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(o))
              for o, r in zip(ours, ref)]  # fmt: skip
    equal = sum(a == b for a, b in pairs) / len(pairs)
    return f"tokens agree {equal:.0%} (first divergence at step {min(firsts)})"


def compare(name, hf, engine, batch, prompt_len, new, repeats, bandwidths=None) -> float:
    prompts = torch.randint(
        0, 8192, (batch, prompt_len), generator=torch.Generator().manual_seed(1)
    )
    run_hf(hf, prompts[:, :8], 2), run_ours(engine, prompts[:, :8], 2)  # warm up
    hf_times, our_times, hf_cpu, our_cpu = [], [], [], []
    for _ in range(repeats):  # alternate, so load changes hit both sides alike
        t_hf, c_hf, out_hf = timed(run_hf, hf, prompts, new)
        t_us, c_us, out_us = timed(run_ours, engine, prompts, new)
        hf_times.append(t_hf)
        our_times.append(t_us)
        hf_cpu.append(c_hf)
        our_cpu.append(c_us)
        if bandwidths is not None:
            bandwidths.append(bandwidth_gbs(device=DEVICE))
    tokens = batch * new
    hf_tps, our_tps = tokens / statistics.median(hf_times), tokens / statistics.median(our_times)
    ratio = our_tps / hf_tps
    cpu_ratio = statistics.median(hf_cpu) / statistics.median(our_cpu)
    target = TARGETS.get(name)
    verdict = (
        "" if target is None else f"(target >= {target}x: {'ok' if ratio >= target else 'MISSED'})"
    )
    if target is not None:
        VERDICTS[f"{name} >= {target}x"] = ratio >= target
    print(f"{name:12s} B={batch:<3d} prompt={prompt_len:<5d} new={new:<4d} "
          f"transformers {hf_tps:8.1f} tok/s | lmforge {our_tps:8.1f} tok/s | "
          f"ratio {ratio:5.2f}x {verdict} | in CPU time {cpu_ratio:5.2f}x | "
          f"{agreement(out_us, out_hf)}", flush=True)  # fmt: skip
    ROWS.append([name, batch, prompt_len, new, f"{hf_tps:.1f}", f"{our_tps:.1f}", f"{ratio:.2f}x",
                 f"{cpu_ratio:.2f}x", agreement(out_us, out_hf)])  # fmt: skip
    return our_tps


@torch.inference_mode()
def accuracy(hf, engine, length: int = 320) -> str:
    """Teacher-forced on fp32 transformers' greedy sequence: top-1 agreement and logit error."""
    prompt = torch.randint(0, 8192, (1, 64), generator=torch.Generator().manual_seed(2))
    seq = torch.cat([prompt, torch.tensor(run_hf(hf, prompt, length - 64))], dim=1).to(DEVICE)
    ref = hf(seq).logits[0, 63:-1].float()
    ours = engine.model(seq)[0, 63:-1].float()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (ours - ref).abs()
    return (f"teacher-forced on {ref.shape[0]} positions vs fp32 transformers: top-1 agreement "
            f"{top1:.1%}, max |logit error| {err.max().item():.4f}, mean {err.mean().item():.4f} "
            f"(logit std {ref.std().item():.3f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="lmforge activation (and weight, unless quantised) dtype; auto: "
                        "what the engine picks on this CPU; transformers stays fp32")  # fmt: skip
    parser.add_argument(
        "--quantize",
        default="int8",
        choices=["int8", "int4", "none"],
        help="lmforge weight-only quantisation of the Linear layers",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--no-record", action="store_true", help="print only (--quick never records)"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda (on cuda transformers runs in --dtype and lmforge uses CUDA graphs)",
    )
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    quantize = None if args.quantize == "none" else args.quantize
    from transformers import AutoModelForCausalLM

    from lmforge.infer.engine import Engine
    from lmforge.infer.quantize import decode_bytes, weight_bytes
    from lmforge.lm import LM

    with tempfile.TemporaryDirectory() as directory:
        make_checkpoint(directory)
        gpu_dtype = torch.bfloat16 if args.dtype == "auto" else getattr(torch, args.dtype)
        hf_dtype = torch.float32 if args.device == "cpu" else gpu_dtype
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=hf_dtype).eval().to(DEVICE)
        lm = LM.load(directory)
        lm.model.to(DEVICE)
    t = time.perf_counter()
    engine = Engine.from_lm(lm, max_batch=16, max_len=2048 + 64, compile=args.compile,
                            dtype=args.dtype, quantize=quantize)  # fmt: skip
    setup = time.perf_counter() - t
    read = decode_bytes(engine.model)
    n_params = sum(p.numel() for p in lm.model.parameters()) / 1e6
    print(
        f"model: {n_params:.1f}M parameters; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})"
    )
    print(
        f"precision: transformers {str(hf.dtype).removeprefix('torch.')} weights and activations"
        f" | lmforge {engine.precision} "
        f"({weight_bytes(engine.model) / 2**20:.0f} MiB of weights, "
        f"{read / 2**20:.1f} MiB read per decoded token; engine setup {setup:.1f} s)"
    )
    new, long_prompt = (32, 512) if args.quick else (256, 2048)
    bandwidths: list[float] = []
    b1 = compare("batch 1", hf, engine, 1, 64, new, args.repeats, bandwidths)
    compare("batch 16", hf, engine, 16, 64, new, args.repeats)
    compare("long prompt", hf, engine, 1, long_prompt, 64 if not args.quick else 16, args.repeats)
    if args.compile:
        print("compiled decode step: first call includes compilation (warm-up, not timed)")
    lines = [f"precision: transformers {str(hf.dtype).removeprefix('torch.')}, lmforge "
             f"{engine.precision}; {torch.get_num_threads()} thread(s); median of {args.repeats} "
             "alternating runs; 'in CPU time': the ratio of the process's CPU seconds per run "
             "(what a loaded host's waits for a core leave out)."]  # fmt: skip
    if engine.precision != "float32":
        lines.append(accuracy(hf, engine) + ".")
        print(lines[-1])
    bw = statistics.median(bandwidths)
    bound = bw * 1e9 / read
    ceiling = statistics.median(matmul_ceiling(engine.model, engine.dtype, device=DEVICE)
                                 for _ in range(3))  # fmt: skip
    VERDICTS["batch 1 >= 70% of bound"] = b1 >= 0.7 * bound
    print(
        f"memory bandwidth {bw:.1f} GB/s (1 GiB tensor copy, median of {len(bandwidths)}) -> "
        f"batch-1 bound {bound:.1f} tok/s at {read / 2**20:.1f} MiB/token; lmforge batch 1 = "
        f"{b1 / bound:.0%} of the bound (target >= 70%: {'ok' if b1 >= 0.7 * bound else 'MISSED'})"
    )
    print(
        f"the weight matmuls alone (one GEMV per Linear, nothing else) run {ceiling:.1f} steps/s "
        f"= {ceiling / bound:.0%} of the bound: the kernels' own ceiling at this precision; the "
        f"rest of a step (norms, attention, sampling) takes {1 - b1 / ceiling:.0%} of it"
    )
    met = ", ".join(f"{k}: {'ok' if v else 'MISSED'}" for k, v in VERDICTS.items())
    print(f"summary for lmforge {engine.precision}: {met}")
    print("note: shared, loaded 2-core machine; compare ratios, not absolute numbers")
    if args.quick or args.no_record:
        return
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.results import record

    lines += [
        f"Copy bandwidth {bw:.1f} GB/s; batch 1 = {b1 / bound:.0%} of the bandwidth bound "
        f"({read / 2**20:.1f} MiB read per token); the weight matmuls alone "
        f"{ceiling / bound:.0%} of it.",
        f"Targets: {met}.",
        "Host: " + subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip() + ".",
    ]
    threads = torch.get_num_threads()
    name = f"generate_{args.device}_{args.quantize}_{args.dtype}" + "_compiled" * args.compile
    name += f"_{threads}threads" * (threads > 1)
    title = (
        f"Engine vs transformers.generate, 32M Llama ({args.device}, lmforge "
        f"{engine.precision} vs transformers {str(hf.dtype).removeprefix('torch.')}, "
        f"{threads} thread{'s' * (threads > 1)})"
    )
    record(name.replace(":", "-").lower(), title, COLUMNS, ROWS, notes=" ".join(lines))


if __name__ == "__main__":
    main()
