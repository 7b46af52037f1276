"""Decode and prefill of a Q4_0 GGUF in the int4 kernel's two layouts, in one process.

`LM.load(x.gguf)` holds llama.cpp's Q4_0 blocks in the int4 kernel's symmetric layout (codes and
an fp16 scale per 32 weights: 4.5 bits a weight, as in the file). The same codes also fit the
asymmetric layout (an fp16 offset m = -8 d beside each scale: 5 bits, what Q4_0 files were held
in before), with bit-identical outputs. This loads the file once, keeps both packings of every
Q4_0 layer, and times the model with each in turn (alternating, `--repeats` rounds): batch 1,
prefill = a `--prompt`-token prompt timed as a one-token generation, decode = the extra time of
`--new` more tokens; `LM.generate` (the default eager engine). The engine's per-token overhead
dilutes the kernels' share, so the kernels alone are timed too: one pass of `int4_matmul` over
every Q4_0 layer at one row (a decode step's weight stream), in this CPU's variant and in the
AVX2 one (AVX2-only CPUs), alternating the layouts likewise.

    python benchmarks/bench_int4_layouts.py --gguf smollm2-Q4_0.gguf --threads 1 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.results import add_speed_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, required=True, help="a GGUF whose int4 tensors are Q4_0")
    add_speed_args(p, "int4_layouts", repeats=5)
    args = p.parse_args()
    from benchmarks.protocol import paired_bootstrap
    from lmforge.infer.cpu_kernels import native_kernels, pack_int4, unpack_int4
    from lmforge.infer.int4_linear import Int4Linear
    from lmforge.lm import LM

    torch.set_num_threads(args.threads)
    lm = LM.load(args.gguf)
    layers = [m for m in lm.model.modules() if isinstance(m, Int4Linear) and m.symmetric]
    if not layers:
        raise SystemExit(f"{args.gguf}: no Q4_0 tensor held in the symmetric int4 layout")
    packings = {"symmetric (Q4_0's 4.5 bits)": [], "asymmetric, m = -8 d (5 bits)": []}
    for layer in layers:
        packed = layer._buffers["native_packed"]
        codes, d, _ = unpack_int4(packed, layer.out_features)
        packings["symmetric (Q4_0's 4.5 bits)"].append(packed)
        packings["asymmetric, m = -8 d (5 bits)"].append(pack_int4(codes, d, -8 * d))

    def use(name: str) -> None:
        for layer, packed in zip(layers, packings[name]):
            layer._buffers["native_packed"] = packed

    ids = torch.randint(100, lm.config.vocab_size - 100, (args.prompt,),
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    prompt = [int(i) for i in ids]

    def run(n: int) -> list[int]:
        return lm.generate([prompt], max_new_tokens=n, temperature=0.0, eos_ids=[])[0]

    outputs, pp, tg = {}, {n: [] for n in packings}, {n: [] for n in packings}
    load = os.getloadavg()[0]
    for name in packings:  # warm-up; the two layouts must give the same tokens
        use(name)
        outputs[name] = run(8)
    same = len(set(map(tuple, outputs.values()))) == 1
    for r in range(args.repeats):
        for name in list(packings)[:: 1 if r % 2 == 0 else -1]:  # ABBA: no order favoured
            use(name)
            t = time.perf_counter()
            run(1)
            first = time.perf_counter() - t
            t = time.perf_counter()
            run(args.new + 1)
            full = time.perf_counter() - t
            pp[name].append(args.prompt / first)
            tg[name].append(args.new / (full - first))
    kernels = native_kernels()
    variants = list(dict.fromkeys([kernels.variant, "avx2"]))  # this CPU's, then AVX2's
    variants = [v for v in variants if v in kernels.variants()]
    passes = {(n, v): [] for n in packings for v in variants}
    xs = {k: torch.randn(1, k) for k in {layer.in_features for layer in layers}}
    mine = kernels.variant
    try:
        for variant in variants:
            kernels.use(variant)
            for r in range(args.repeats * 4):
                for name, packed in list(packings.items())[:: 1 if r % 2 == 0 else -1]:
                    t = time.perf_counter()
                    for layer, w in zip(layers, packed):
                        kernels.int4_matmul(xs[layer.in_features], w, layer.out_features)
                    passes[name, variant].append(time.perf_counter() - t)
    finally:
        kernels.use(mine)
    base = statistics.median(tg["asymmetric, m = -8 d (5 bits)"])
    rows = []
    for name, packed in packings.items():
        mib = sum(t.numel() for t in packed) / 2**20
        decode = statistics.median(tg[name])
        kernel_ms = [round(1e3 * statistics.median(passes[name, v]), 2) for v in variants]
        rows.append([name, round(mib, 1), round(decode, 1), f"{decode / base:.2f}x",
                     round(statistics.median(pp[name]), 1), *kernel_ms])  # fmt: skip
        print(rows[-1], flush=True)
    columns = ["int4 layout of the Q4_0 tensors", "their MiB", "decode tok/s",
               "decode / asymmetric", "prefill tok/s",
               *[f"kernel pass ms ({v})" for v in variants]]  # fmt: skip
    notes = (
        f"{args.gguf.name}: {len(layers)} Q4_0 layers, the same codes in both layouts "
        f"(greedy tokens identical: {'yes' if same else 'NO'}). Batch 1, {args.prompt}-token "
        f"prompt, {args.new} greedy tokens, LM.generate (eager), {args.threads} thread(s); "
        f"medians of {args.repeats} rounds alternating the layouts (ABBA) in one process. "
        f"Kernel pass: int4_matmul over the {len(layers)} layers at one row, median of "
        f"{args.repeats * 4} alternating passes per variant. Host load "
        f"average at start: {load:.1f} (2 cores shared)."
    )
    sym, asym = packings  # paired by round: the symmetric layout's gain and its 95% CI
    ci = paired_bootstrap(tg[sym], tg[asym])
    kci = [paired_bootstrap([1e3 * t for t in passes[sym, v]], [1e3 * t for t in passes[asym, v]])
           for v in variants]  # fmt: skip
    notes += (
        f" Symmetric minus asymmetric, paired by round (mean, 95% bootstrap CI): decode "
        f"{ci.diff:+.1f} tok/s [{ci.low:+.1f}, {ci.high:+.1f}]; kernel pass "
        + "; ".join(
            f"{v} {c.diff:+.3f} ms [{c.low:+.3f}, {c.high:+.3f}]" for v, c in zip(variants, kci)
        )  # fmt: skip
        + "."
    )
    print(notes)
    if not args.no_record:
        from benchmarks.results import record

        record(args.name, "int4 layouts on a Q4_0 GGUF: symmetric vs asymmetric", columns, rows,
               notes)  # fmt: skip


if __name__ == "__main__":
    main()
