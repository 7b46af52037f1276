"""16-bit GGUF weights (F16, BF16) at batch 1: lmforge's kernels for one instruction set against
llama.cpp built for that same instruction set, so that each pair runs the same vector width.

lmforge loads the file as stored (`LM.load`: HalfLinear over the F16 / BF16 tensors) and runs
the native kernel variant named by each `--pair` (LMFORGE_KERNEL_VARIANT, cpu_kernels.py
`pick_variant`): `avx512_bf16` beside a llama.cpp built with its native flags on this CPU, and
`avx2` beside one built for AVX2 only, as an AVX2-only CPU (Zen 1-3, Haswell) would run both:

    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B llama-avx2 -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON \\
        -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DLLAMA_OPENSSL=OFF \\
        -DBUILD_SHARED_LIBS=OFF
    cmake --build llama-avx2 -j1 --target llama-bench

Speed as bench_llama_bench.py measures it (its child script, one fresh process per run): a
`--prompt`-token random prompt, then `--gen` greedy tokens; lmforge's Engine eager and compiled
(max_batch 1), prefill timed as a 1-token generation, decode as the extra time of `--gen` more;
llama.cpp's `llama-bench` pp / tg. The three alternate, `--repeats` times; medians.

    python benchmarks/bench_half_weights.py --gguf smollm2-F16.gguf smollm2-BF16.gguf \\
        --pair avx512_bf16=llama-build/bin --pair avx2=llama-avx2/bin
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_llama_bench import (  # noqa: E402 - after the path
    LMFORGE_SPEED,
    SPEED_COLUMNS,
    child,
    parse_llama_bench,
    run_measured,
)
from benchmarks.results import add_speed_args  # noqa: E402

# with the avx2 variant torch's own kernels (ATen, Inductor's generated code, oneDNN) are capped
# at AVX2 too, by their environment variables: the whole process as an AVX2-only CPU runs it
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, nargs="+", required=True)
    p.add_argument("--pair", nargs="+", required=True, metavar="VARIANT=BIN",
                   help="a kernel variant and the llama.cpp bin folder to pair")  # fmt: skip
    p.add_argument("--cache", default="~/.cache/lmforge/compile", help="compile cache (as chat's)")
    add_speed_args(p, "half_weights", new=128)
    args = p.parse_args()
    pairs = [(v, Path(b)) for v, b in (pair.split("=", 1) for pair in args.pair)]
    cache, t = str(Path(args.cache).expanduser()), args.threads
    load_start = [round(x, 1) for x in os.getloadavg()]
    rows, builds = [], {}
    for path in args.gguf:
        for variant, binary in pairs:
            os.environ["LMFORGE_KERNEL_VARIANT"] = variant  # the children's kernels
            for key, value in AVX2_ONLY.items():  # and torch's own, as on such a CPU
                if variant == "avx2":
                    os.environ[key] = value
                else:
                    os.environ.pop(key, None)
            runs = {"eager": [], "compiled": [], "llama.cpp": []}
            for _ in range(args.repeats):  # alternate: one run of each, then again
                for mode in ("eager", "compiled"):
                    runs[mode].append(child(LMFORGE_SPEED, t, path, mode, t, args.prompt,
                                            args.new, "1", f"{cache}/{variant}"))  # fmt: skip
                cmd = [str(binary / "llama-bench"), "-m", str(path), "-p", str(args.prompt),
                       "-n", str(args.new), "-t", str(t), "-r", "1", "-o", "json"]  # fmt: skip
                pp, tg, system = parse_llama_bench(run_measured(cmd)[0])
                runs["llama.cpp"].append({"pp1": pp, "tg1": tg})
                builds[str(binary)] = system["build_commit"]
            tg = [round(statistics.median(r["tg1"] for r in v), 1) for v in runs.values()]
            pp = [round(statistics.median(r["pp1"] for r in v), 1) for v in runs.values()]
            rows.append([path.name, variant, binary.parent.name, *tg, f"{tg[1] / tg[2]:.2f}x",
                         f"{tg[0] / tg[2]:.2f}x", *pp, f"{max(pp[:2]) / pp[2]:.2f}x"])  # fmt: skip
            print(rows[-1], flush=True)
    load_end = [round(x, 1) for x in os.getloadavg()]
    columns = ["file", "lmforge variant", "llama.cpp build", *SPEED_COLUMNS]
    notes = (f"Batch 1, {t} thread(s): a {args.prompt}-token random prompt, then {args.new} "
             "greedy tokens (llama-bench pp/tg). lmforge: LM.load's default (the file's 16-bit "
             "weights as stored), its native kernels forced to the variant named "
             "(LMFORGE_KERNEL_VARIANT; with avx2 torch's kernels capped at AVX2 too: "
             "ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2; a compile cache per variant); "
             "eager = "
             "EngineConfig(compile=False), compiled = "
             "compile=True (prefill is eager in both). llama.cpp builds (folder: commit): "
             f"{json.dumps(builds)}; the AVX2 one built with GGML_NATIVE=OFF, AVX/AVX2/FMA/F16C "
             f"on, AVX-512 off. Medians of {args.repeats} alternating runs (eager, compiled, "
             f"llama.cpp in turn), each a fresh process. Load average at start {load_start}, "
             f"at the end {load_end} (2 cores shared with other jobs).")  # fmt: skip
    print(notes)
    if not args.no_record:
        from benchmarks.results import record

        record(args.name, "16-bit GGUF weights against llama.cpp of the same instruction set",
               columns, rows, notes)  # fmt: skip


if __name__ == "__main__":
    main()
