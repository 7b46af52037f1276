"""The CPU decode step compiled ahead of time with AOTInductor (Engine(compile=True) on CPU).

torch.compile runs a compiled step through dynamo on every call: guard checks, fetching the ~120
weights from the decoder's objects, converting them for the C++ wrapper: ~0.3 ms of a ~2.9 ms
token on the bench model at one thread. Here the step is exported once (`torch.export`) and
compiled by AOTInductor into a shared library holding the weights as constants: a call passes
the token ids, positions, key mask and KV buffers to C++ and nothing else. The step also takes
the argmax and advances the positions, because the host's work after a step runs cold (streaming
the weights evicted its caches; the first torch ops after a step cost ~20 us each).

The KV buffers and positions are updated in place (the export records them as mutated inputs).
Dynamic: the running rows and the cache length. Each export holds for a range of rows (narrowed
by the model's own branches: Int8Linear switches kernels at 8 rows), so batch 1, 2-7 and 8+
each compile once. Compiling is slow: the C++ of one range takes 60-70 s for SmolLM2-135M on a
quiet 2-core AMD EPYC, and ~110 s for a one-layer toy model on the same machine under load
(mostly the C++ compiler, whatever the model's size). So a server compiles every range before it
reports ready (`warm_up`), and keeps the compiled packages on disk (`cache_dir`, keyed by the
weights, their precision, the cache shape, the torch version and the CPU's vector ISA): a restart
loads them in about a second instead of compiling again. A shape outside every range (the very
last cache column, for some models) runs eagerly, as does everything if compiling fails (no C++
compiler). Covers decoder.FastDecoder on CPU without dynamic RoPE scaling; the engine uses
torch.compile (compiled_step.py) elsewhere. The weights are copied into each compiled step when
it compiles: build a new engine after changing them.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lmforge.infer.cpu_features import cpu_features
from lmforge.infer.decoder import FastDecoder, fixed_step_unsupported
from lmforge.model.cache import SlotCache


def exportable(forward, device: torch.device) -> bool:
    """Whether ExportedDecodeStep covers this forward on this device."""
    return device.type == "cpu" and fixed_step_unsupported(forward) is None


class _CacheView:
    """What FastDecoder needs of a cache, built from the exported step's inputs: the running
    rows' key mask [n, length + 1] (its width carries the cache length) and the KV buffers."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], key_mask: torch.Tensor):
        self.k, self.v, self.key_mask = k, v, key_mask
        self.length = key_mask.shape[1] - 1

    update = SlotCache.update  # the same in-place write of the running rows' new column

    def advance(self, n: int) -> None:
        pass  # the engine's SlotCache advances after the step


class _Step(nn.Module):
    """The function exported: one decode step -> float32 logits [n, V] and their argmax; the
    positions move on by one in place. The host's work after a step runs cold (streaming the
    weights evicted its caches: each first torch op costs ~20 us), so what can be done in the
    compiled code is done there."""

    def __init__(self, decoder: FastDecoder):
        super().__init__()
        self.model, self.decoder = decoder.model, decoder  # model: weights get stable names

    def forward(self, ids, positions, key_mask, k: list[torch.Tensor], v: list[torch.Tensor]):
        cache = _CacheView(k, v, key_mask)
        logits = self.decoder(ids, positions=positions, cache=cache, last_only=True)[:, -1]
        positions.add_(1)
        logits = logits.float()
        return logits, logits.max(dim=-1).indices


class ExportedDecodeStep:
    """The engine's decode step: (ids [n, 1], cache) -> (logits [n, V], greedy tokens [n]),
    advancing the cache and its rows' positions. Compiles a step per range of running rows on
    first need, or all of them at once with `warm_up`; with `use_cache_dir` the compiled steps
    are also kept on disk and loaded from there by the next engine over the same weights."""

    def __init__(self, decoder: FastDecoder, cache: SlotCache):
        self.step, self.cache = _Step(decoder), cache
        self.compiled: list[tuple[range, range, object]] = []  # (rows, widths, model)
        self.counts = {"compiled": 0, "loaded": 0}  # steps compiled here / loaded from disk
        self.dir: Path | None = None  # where compiled packages go (a temporary one by default)
        self._tmp: tempfile.TemporaryDirectory | None = None

    def use_cache_dir(self, root: str | Path) -> Path:
        """Keep compiled steps under root/<key> (key: see cache_key) and reuse those already
        there; returns that folder.

        A package holds a shared library that is loaded into this process, i.e. code that runs
        here: acceptable because the folder is this user's own (made 0700 under ~/.cache), it
        is only ever written by this code, and the archive holds C++ sources, JSON metadata and
        the library (no pickle). Never point it at a folder others can write to."""
        folder = Path(root).expanduser() / cache_key(self.step, self.cache)
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.dir = folder
        return folder

    def covers(self, n: int) -> range | None:
        """The range of running rows, holding n, that already has a step (compiled, loaded, or
        eager after a failed compile); None when n has none yet."""
        return next((rows for rows, _, _ in self.compiled if n in rows), None)

    def warm_up(self, max_rows: int, progress: Callable[[str], None] = print) -> None:
        """Compile (or load from the cache folder) the step for every number of running rows
        from 1 to max_rows now, so that no request waits for a compiler; reports each range."""
        n = 1
        while n <= max_rows:
            rows = self.covers(n)
            if rows is None:
                example = self._example(n)
                cached = self._entry(n) is not None
                slow = "" if cached else " (a minute or more)"
                progress(f"{'loading' if cached else 'compiling'} the decode step for {n} "
                         f"running row(s){slow}")  # fmt: skip
                began = time.perf_counter()
                self._compiled_for(n, example[2].shape[1], *example)
                rows = self.covers(n)
                top = min(rows.stop - 1, max_rows)
                progress(f"  rows {rows.start}-{top}: {'loaded' if cached else 'compiled'} in "
                         f"{time.perf_counter() - began:.1f} s")  # fmt: skip
            n = rows.stop

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache
        n, width = ids.shape[0], cache.length + 1
        positions = cache.positions[:n, None]
        key_mask = cache.mask[:n, :width].contiguous()  # the compiled code assumes dense inputs
        run = self._compiled_for(n, width, ids, positions, key_mask)
        if run is None:  # outside every exported range (the cache's last column): run eagerly
            logits, tokens = self.step(ids, positions, key_mask, cache.k, cache.v)
        else:
            logits, tokens = run([ids, positions, key_mask, *cache.k, *cache.v])
        cache.advance(1)
        return logits, tokens

    def _example(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs shaped like a decode step's with n running rows (copies: nothing runs on
        them, but the export must not be able to touch the live cache's rows). The width is
        neither 1 nor 2 lest the export specialise on it."""
        cache = self.cache
        width = max(3, min(16, cache.mask.shape[1] - 1))
        ids = torch.zeros(n, 1, dtype=torch.long, device=cache.mask.device)
        return ids, cache.positions[:n, None].clone(), cache.mask[:n, :width].clone()

    def _compiled_for(self, n, width, *example):
        for rows, widths, run in self.compiled:
            if n in rows:
                return run if width in widths else None
        try:
            entry = self._entry(n)
            if entry is not None:
                rows, widths = range(*entry["rows"]), range(*entry["widths"])
                run = _load(self.dir / entry["file"], len(self.cache.k))
                self.counts["loaded"] += 1
            else:
                rows, widths, run = self._compile(*example)
                self.counts["compiled"] += 1
        except Exception as err:  # e.g. no C++ compiler, an older torch: decode eagerly
            warnings.warn(f"compiling the decode step failed, decoding without it: {err}",
                          stacklevel=3)  # fmt: skip
            rows, widths, run = range(2**62), range(0), None
        self.compiled.append((rows, widths, run))
        return run if n in rows and width in widths else None

    def _entry(self, n: int) -> dict | None:
        """The cache folder's record of a compiled step whose rows hold n, if any."""
        entries = _read_index(self.dir) if self.dir is not None else []
        return next((e for e in entries
                     if e["rows"][0] <= n < e["rows"][1] and (self.dir / e["file"]).is_file()),
                    None)  # fmt: skip

    @torch.no_grad()
    def _compile(self, ids, positions, key_mask):
        """Export and AOT-compile the step for inputs shaped like these; returns the ranges of
        rows and widths the export holds for (narrowed by the model's own branches)."""
        n = ids.shape[0]
        dyn = torch.export.Dim.AUTO  # dynamic unless the code fixes it (e.g. all slots full)
        rows = {0: dyn} if n > 1 else None  # batch 1 is its own specialisation
        k, v = self.cache.k, self.cache.v
        shapes = (rows, rows, {0: dyn, 1: dyn} if n > 1 else {1: dyn}, [None] * len(k),
                  [None] * len(v))  # fmt: skip
        with warnings.catch_warnings():  # Int8Linear's lazily made GEMM weight: an in-graph cast
            warnings.filterwarnings("ignore", message=".*were assigned during export")
            ep = torch.export.export(self.step, (ids, positions, key_mask, k, v),
                                     dynamic_shapes=shapes, strict=False)  # fmt: skip
        if self.dir is None:
            self._tmp = self._tmp or tempfile.TemporaryDirectory(prefix="lmforge-aoti-")
            self.dir = Path(self._tmp.name)
        name = f"decode_{n}_{os.getpid()}_{len(self.compiled)}.pt2"
        partial = self.dir / f".partial-{name}"  # renamed when complete: no reader sees half
        # threads read at run time (omp_get_max_threads): inductor otherwise bakes in the count
        # at compile time, and a package cached under 2 threads would run 2 in a 1-thread server
        torch._inductor.aoti_compile_and_package(
            ep, package_path=str(partial), inductor_configs={"cpp.dynamic_threads": True}
        )
        os.replace(partial, self.dir / name)
        dims = next(node for node in ep.graph.nodes if node.op == "placeholder" and
                    node.name == ep.graph_signature.user_inputs[2]).meta["val"].shape  # fmt: skip
        # no more rows than slots, no wider than the mask: bounds the export may leave open
        slots, most = self.cache.mask.shape
        found, widths = _range(ep, dims[0], slots), _range(ep, dims[1], most)
        _add_to_index(self.dir, {"file": name, "rows": [found.start, found.stop],
                                 "widths": [widths.start, widths.stop]})  # fmt: skip
        return found, widths, _load(self.dir / name, len(k))


def _load(path: Path, n_layers: int):
    """A compiled package's flat entry point: [ids, positions, key_mask, *k, *v] -> outputs."""
    with warnings.catch_warnings():  # torch-internal deprecation noise on loading
        warnings.simplefilter("ignore", FutureWarning)
        model = torch._inductor.aoti_load_package(str(path))
    # The flat entry point: the model's __call__ parses its input spec (JSON) every call.
    run = getattr(getattr(model, "loader", None), "boxed_run", None)
    return run or (
        lambda flat: list(model(*flat[:3], flat[3 : 3 + n_layers], flat[3 + n_layers :]))
    )


INDEX = "index.json"


def _read_index(folder: Path) -> list[dict]:
    try:
        entries = json.loads((folder / INDEX).read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: compile again
        return []
    return [e for e in entries if isinstance(e, dict) and {"file", "rows", "widths"} <= set(e)]


def _add_to_index(folder: Path, entry: dict) -> None:
    entries = [e for e in _read_index(folder) if e["rows"] != entry["rows"]] + [entry]
    partial = folder / f".{INDEX}.{os.getpid()}.partial"
    partial.write_text(json.dumps({"entries": entries}, indent=1))
    os.replace(partial, folder / INDEX)


def cache_key(step: nn.Module, cache: SlotCache) -> str:
    """What a compiled step depends on, hashed: the weights (they are constants in the
    library) and their dtypes, the KV cache's shapes (static inputs), the source of every
    module the step runs (a changed lmforge recompiles), the torch version and the CPU (the
    library's vector ISA: a package built with AVX-512 would crash on an AVX2 host)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    digest = hashlib.sha256()
    modules = {type(m).__module__ for m in step.modules()} | {
        type(step.decoder).__module__, __name__, type(cache).__module__}  # fmt: skip
    sources = {name: _source_hash(name) for name in sorted(modules)}
    meta = {
        "torch": torch.__version__,
        "isa": str(pick_vec_isa()),
        "cpu": [platform.machine(), cpu_features().model],
        "kv": [[list(t.shape), str(t.dtype)] for t in (*cache.k, *cache.v)],
        "mask": [list(cache.mask.shape), str(cache.positions.dtype)],
        "sources": sources,
    }
    digest.update(json.dumps(meta, sort_keys=True).encode())
    for name, tensor in sorted(step.state_dict(keep_vars=False).items()):
        tensor = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


@functools.cache
def _source_hash(module: str) -> str:
    """The hash of a module's source, read once per process: the file may be edited while a
    server runs, but the code that runs (and that a compiled step was made from) stays."""
    try:
        return hashlib.sha256(inspect.getsource(sys.modules[module]).encode()).hexdigest()
    except (OSError, TypeError, KeyError):  # no source file (e.g. a frozen build)
        return "?"


def _range(ep, size, most: int) -> range:
    """The values an exported input size may take (a static size: just itself), at most `most`."""
    expr = size.node.expr if isinstance(size, torch.SymInt) else size
    if expr not in ep.range_constraints:  # static, or fixed by the code (e.g. all slots full)
        return range(int(expr), int(expr) + 1)
    bounds = ep.range_constraints[expr]
    # torch's int_oo claims is_finite; float() tells (an unbounded width: nothing in the step
    # ties the cache length to the buffers' size when attention is an external op)
    upper = int(bounds.upper) if math.isfinite(float(bounds.upper)) else most
    return range(int(bounds.lower), min(upper, most) + 1)
