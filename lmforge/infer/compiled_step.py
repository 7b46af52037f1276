"""torch.compile for the engine's decode step (Engine(compile=True), `lmforge serve --compile`).

Eagerly, half of a batch-1 decode step on a CPU is spent outside the weight matmuls: ~15 small
ops per layer, each a dispatch of a few microseconds. Inductor fuses the norms, RoPE and residual
adds into a few C++ loops, runs attention as one fused loop (decoder.decode_attention) and, on
CPU, calls everything from C++ (`cpp_wrapper`), leaving the int8 GEMVs as most of the step.
Three things keep the compiled step cheap per call: the KV cache is written in place (one tensor
per layer: slices of one shared buffer were functionalised into whole-buffer copies); only the
running rows and the cache length are dynamic; dynamo's guards are checked on the inputs only.
It compiles for ~30 s on first use (3 graphs for a run where rows join and leave), so it is
opt-in, and a server compiles before it reports ready (`warm_up_by_decoding`). Measured on the
32M bench model, int8, one thread: 4.5x transformers at batch 1 and
65-74% of the memory-bandwidth bound, against 2.7x and 41% eagerly (bench_generate.py). On CPU
the engine now runs decoder.FastDecoder's step ahead-of-time compiled instead (exported_step.py:
no dynamo on each call, ~20% faster again); this path serves GPUs (inside the CUDA graph) and
the models FastDecoder does not cover.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lmforge.model.cache import SlotCache


def compile_decode_step(forward, cache: SlotCache):
    """`torch.compile` for the decode step: what varies is dynamic, the rest fixed and unguarded.

    Dynamic: the number of running rows (marked on each call; batch size 1 gets its own graph)
    and the cache length (an int that changes every step: dynamo makes it symbolic after the
    first change). Everything else is static: with `dynamic=True` every weight and buffer size
    became a symbolic argument the compiled step converts on each call (26 cost ~80 us a
    step). The decoder's weights and structure are fixed for the engine's life, so the guards
    dynamo would re-check on every call (on each weight and closure: ~0.1 ms a token) are
    skipped."""
    options: dict = {"cpp_wrapper": cache.mask.device.type == "cpu"}  # Python wrapper: ~0.2 ms
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # torch >= 2.8
        fixed = ("L['fn']", "L['self']")  # the decoder object / the model module
        options["guard_filter_fn"] = lambda entries: [not e.name.startswith(fixed) for e in entries]
    compiled = torch.compile(forward, options=options)

    def step(ids, positions, cache, last_only):
        if ids.shape[0] > 1:
            for t in (ids, positions, cache.key_mask):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(ids, positions=positions, cache=cache, last_only=last_only)

    return step


def warm_up_by_decoding(engine, progress: Callable[[str], None] = print) -> None:
    """Decode a few greedy tokens at batch sizes 1, 2, 8 and max_batch (those up to max_batch),
    so that torch.compile makes its graphs (batch 1 is its own, Int8Linear's switch of kernels
    at 8 rows splits the rest, the cache length turns symbolic on the second step) and the CUDA
    graphs are captured now, not inside the first requests. inductor keeps what it compiled in
    its own cache (TORCHINDUCTOR_CACHE_DIR; `lmforge serve` points it under ~/.cache/lmforge):
    a restart traces again but compiles nothing."""
    from lmforge.infer.params import GenerationParams

    sizes = sorted({s for s in (1, 2, 8, engine.max_batch) if s <= engine.max_batch})
    length = max(1, min(4, engine.max_len - 4))  # room for the prompt and three new tokens
    params = GenerationParams(max_new_tokens=3, temperature=0.0, stop_token_ids=[])
    for n in sizes:
        progress(f"compiling the decode step for {n} running row(s)")
        began = time.perf_counter()
        engine.generate([[0] * length] * n, params)
        progress(f"  batch size {n}: ready in {time.perf_counter() - began:.1f} s")
