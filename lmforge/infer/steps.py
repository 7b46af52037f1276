"""The engine's decode steps besides the eager one (engine.EagerStep): the model's own forward
compiled or recorded, behind one interface. `Engine.__init__` picks one:

- `ExportedStep`: on CPU with `compile=True`, the step exported once (`torch.export`) and compiled
  ahead of time by AOTInductor into a shared library that reads the weights where the model keeps
  them: a call passes the token ids, positions, key mask and KV buffers to C++ and nothing else
  (no dynamo guards or weight fetching per call). It also takes the argmax and advances the
  positions: the host's work after a step runs cold (streaming the weights evicted its caches).
- `compile_forward`: `torch.compile` of the forward (GPUs, and models an export does not cover),
  which engine.CompiledStep runs as the eager step runs the model.
- `GraphStep`: on a GPU (by default), the step recorded as a CUDA graph and replayed: one launch
  per token instead of one per kernel (a small model's decoding is launch-bound).

A step is called with the running rows' next tokens [n, 1] after `SlotCache.begin_decode`,
returns (logits [n, V], greedy tokens [n] or None), and advances the cache by one column and the
rows' positions by one. `warm_up(engine, progress, cache_dir)` prepares every batch size before
the first request (a server calls it before it reports ready). Timings: docs/inference.md.

ExportedStep: the KV buffers and positions are updated in place (the export records them as
mutated inputs); the running rows and the cache length are dynamic. Each export holds for a range
of rows (narrowed by the model's own branches: Int8Linear switches kernels at 8 rows), so batch 1,
2-7 and 8+ each compile once; compiling takes a minute or more, mostly the C++ compiler, so a
server compiles every range before it reports ready and keeps the packages on disk (`cache_dir`,
keyed by the weights' names, shapes and precision, the cache shape, the torch version and the
CPU's vector ISA): a restart loads them in about a second. A shape outside every range (the very
last cache column, for some models) runs eagerly, as does everything if compiling fails (no C++
compiler).
The library holds no weights of its own (AOTInductor's `package_constants_in_so=False`): once
loaded, it is handed the model's tensors (`load_constants(..., user_managed=True)`), so every
compiled range shares the one copy the eager model decodes with (a copy per range tripled a
16-bit model's memory). Weights changed in place are seen; replaced tensors are not: build a
new engine after loading others.

GraphStep: a graph replays fixed shapes and fixed addresses, so the recorded step is static: the
batch is padded up to a bucket (1, 2, 4, 8, ... rows), one graph per bucket; attention covers the
whole KV buffer, the padding mask hiding the columns not yet written; the column the new keys go
to is a device tensor (`index_copy_`), not a Python int; the inputs are the engine's persistent
tensors, updated in place between steps. Rows past the running ones compute values nobody reads
and write keys into free slots that a joining sequence overwrites. It also runs without graphs
(`use_graphs=False`): that is how the CPU tests check the static step.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lmforge.infer.compile_cache import add_to_index, cache_key, prune_compile_cache, read_index
from lmforge.infer.memory import return_freed_memory
from lmforge.infer.params import GenerationParams
from lmforge.model.cache import SlotCache
from lmforge.model.mlp import MLP
from lmforge.model.positions import rope_scaling_type
from lmforge.model.transformer import Transformer


def fixed_step_unsupported(model) -> str | None:
    """Why a decode step compiled into fixed code (a CUDA graph, an ahead-of-time export) cannot
    run this model; None when it can."""
    if not isinstance(model, Transformer):
        return f"{type(model).__name__} is not a Transformer"
    if not all(isinstance(block.mlp, MLP) for block in model.blocks):
        return "a mixture of experts routes tokens with data-dependent shapes"
    if rope_scaling_type(getattr(model.config, "rope_scaling", None)) == "dynamic":
        return "dynamic RoPE scaling reads the positions on the host every step"
    return None


def exportable(model, device: torch.device) -> bool:
    """Whether ExportedStep covers this model on this device."""
    return device.type == "cpu" and fixed_step_unsupported(model) is None


def compile_forward(model: nn.Module, cache: SlotCache):
    """`torch.compile` for the decode step: what varies is dynamic, the rest fixed and unguarded.

    Dynamic: the number of running rows (marked on each call; batch size 1 gets its own graph)
    and the cache length (an int that changes every step: dynamo makes it symbolic after the
    first change). Everything else is static: with `dynamic=True` every weight and buffer size
    became a symbolic argument the compiled step converts on each call. The model's weights and
    structure are fixed for the engine's life, so the guards dynamo would re-check on every call
    (on each weight and module) are skipped. The KV cache is written in place (one tensor per
    layer: slices of one shared buffer were functionalised into whole-buffer copies)."""
    options: dict = {"cpp_wrapper": cache.mask.device.type == "cpu"}  # no Python wrapper per call
    if hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # torch >= 2.8
        fixed = ("L['fn']", "L['self']")  # the model module
        options["guard_filter_fn"] = lambda entries: [not e.name.startswith(fixed) for e in entries]
    compiled = torch.compile(model, options=options)

    def forward(ids, positions, cache, last_only):
        if ids.shape[0] > 1:
            for t in (ids, positions, cache.key_mask):
                if t is not None:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(ids, positions=positions, cache=cache, last_only=last_only)

    return forward


def warm_up_by_decoding(engine, progress: Callable[[str], None] = print, cache_dir=None) -> None:
    """Decode a few greedy tokens at batch sizes 1, 2, 8 and max_batch (those up to max_batch),
    so that torch.compile makes its graphs (batch 1 is its own, Int8Linear's switch of kernels
    at 8 rows splits the rest, the cache length turns symbolic on the second step) and the CUDA
    graphs are recorded now, not inside the first requests. inductor keeps what it compiled in
    its own cache (TORCHINDUCTOR_CACHE_DIR; `lmforge serve` points it under ~/.cache/lmforge):
    a restart traces again but compiles nothing. (`cache_dir` is ExportedStep's.)"""
    sizes = sorted({s for s in (1, 2, 8, engine.max_batch) if s <= engine.max_batch})
    length = max(1, min(4, engine.max_len - 4))  # room for the prompt and three new tokens
    params = GenerationParams(max_new_tokens=3, temperature=0.0, stop_token_ids=[])
    for n in sizes:
        progress(f"compiling the decode step for {n} running row(s)")
        began = time.perf_counter()
        engine.generate([[0] * length] * n, params)
        progress(f"  batch size {n}: ready in {time.perf_counter() - began:.1f} s")


class StaticCacheView:
    """The engine's SlotCache as a full-width, fixed-shape KV cache for the first `rows` rows."""

    def __init__(self, cache, rows: int, column: torch.Tensor):
        self.cache, self.rows, self.column = cache, rows, column
        self.length = cache.max_len - 1  # the model attends to length + 1 = all columns
        self.key_mask = cache.mask[:rows]

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        k, v = self.cache.k[layer][: self.rows], self.cache.v[layer][: self.rows]
        k.index_copy_(2, self.column, k_new)
        v.index_copy_(2, self.column, v_new)
        return k, v

    def advance(self, n: int) -> None:
        pass


class GraphStep:
    """The decode step in static form (padded batch, full-width attention), replayed as a CUDA
    graph per bucket of batch sizes (`use_graphs=False`: the same static step run directly).
    `forward`: the model, or its `compile_forward`."""

    warm_up = staticmethod(warm_up_by_decoding)

    def __init__(self, forward, cache, next_tokens: torch.Tensor, use_graphs: bool = True):
        self.forward, self.cache, self.next_tokens = forward, cache, next_tokens
        self.use_graphs = use_graphs
        self.column = torch.zeros(1, dtype=torch.long, device=next_tokens.device)
        # the batch sizes that get a graph: powers of two below the slots, and the slots
        below = [1 << i for i in range((cache.slots - 1).bit_length())]
        self.buckets = sorted({1, *below, cache.slots})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, None]:
        """ids: the engine's next_tokens[:n, None] (the graph reads that buffer itself)."""
        n, cache = ids.shape[0], self.cache
        rows = next(b for b in self.buckets if b >= n)
        self.column.fill_(cache.length)
        if not self.use_graphs:
            logits = self._step(rows)[:n]
        else:
            if rows not in self.graphs:
                self._record(rows)
            self.graphs[rows].replay()
            logits = self.outputs[rows][:n]
        cache.advance(1)
        cache.positions[:n] += 1
        return logits, None

    def _step(self, rows: int) -> torch.Tensor:
        view = StaticCacheView(self.cache, rows, self.column)
        ids, positions = self.next_tokens[:rows, None], self.cache.positions[:rows, None]
        return self.forward(ids, positions=positions, cache=view, last_only=True)[:, -1]

    def _record(self, rows: int) -> None:
        """Warm up on a side stream (cuBLAS handles, lazily made buffers), then record. The
        warm-up writes the same keys the real step writes, so it changes nothing."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[rows] = self._step(rows)
        self.graphs[rows] = graph


class _CacheView:
    """What the model needs of a cache, built from the exported step's inputs: the running
    rows' key mask [n, length + 1] (its width carries the cache length) and the KV buffers."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], key_mask: torch.Tensor):
        self.k, self.v, self.key_mask = k, v, key_mask
        self.length = key_mask.shape[1] - 1

    update = SlotCache.update  # the same in-place write of the running rows' new column

    def advance(self, n: int) -> None:
        pass  # the engine's SlotCache advances after the step


class _Step(nn.Module):
    """The function exported: one decode step -> float32 logits [n, V] and their argmax; the
    positions move on by one in place (work the host would do cold after a step is done in the
    compiled code)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model  # a submodule: its weights get stable names

    def forward(self, ids, positions, key_mask, k: list[torch.Tensor], v: list[torch.Tensor]):
        cache = _CacheView(k, v, key_mask)
        logits = self.model(ids, positions=positions, cache=cache, last_only=True)[:, -1]
        positions.add_(1)
        logits = logits.float()
        return logits, logits.max(dim=-1).indices


class ExportedStep:
    """The decode step compiled ahead of time: ids [n, 1] -> (logits [n, V], greedy tokens [n]),
    advancing the cache and its rows' positions. Compiles a step per range of running rows on
    first need, or all of them at once with `warm_up`; with a cache_dir the compiled steps are
    also kept on disk and loaded from there by the next engine over a model of the same
    shapes."""

    def __init__(self, model: nn.Module, cache: SlotCache):
        self.step, self.cache = _Step(model), cache
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
        os.utime(folder)  # used now: the last folder pruning would take
        prune_compile_cache(folder.parent, keep=folder)
        self.dir = folder
        return folder

    def covers(self, n: int) -> range | None:
        """The range of running rows, holding n, that already has a step (compiled, loaded, or
        eager after a failed compile); None when n has none yet."""
        return next((rows for rows, _, _ in self.compiled if n in rows), None)

    def warm_up(self, engine, progress: Callable[[str], None] = print, cache_dir=None) -> None:
        """Compile (or load from cache_dir) the step for every number of running rows from 1 to
        the engine's max_batch now, so that no request waits for a compiler; reports each
        range."""
        if cache_dir is not None:
            self.use_cache_dir(cache_dir)
        n = 1
        while n <= engine.max_batch:
            rows = self.covers(n)
            if rows is None:
                cached = self._entry(n) is not None
                verb, done = ("loading", "loaded") if cached else ("compiling", "compiled")
                slow = "" if cached else " (a minute or more)"
                progress(f"{verb} the decode step for {n} running row(s){slow}")
                began = time.perf_counter()
                self._compiled_for(*self._example(n))
                rows = self.covers(n)
                progress(f"  rows {rows.start}-{min(rows.stop - 1, engine.max_batch)}: {done} in "
                         f"{time.perf_counter() - began:.1f} s")  # fmt: skip
            n = rows.stop

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache
        n, width = ids.shape[0], cache.length + 1
        positions = cache.positions[:n, None]
        key_mask = cache.mask[:n, :width].contiguous()  # the compiled code assumes dense inputs
        run = self._compiled_for(ids, positions, key_mask)
        if run is None:  # outside every exported range (the cache's last column): run eagerly
            logits, tokens = self.step(ids, positions, key_mask, cache.k, cache.v)
        else:
            logits, tokens = run([ids, positions, key_mask, *cache.k, *cache.v])
            if logits.shape[0] != n:  # an export that fixed its example's row count: wrong rows
                self._distrust(n, logits.shape[0])  # re-run eagerly (same cache column)
                logits, tokens = self.step(ids, positions, key_mask, cache.k, cache.v)
        cache.advance(1)
        return logits, tokens

    def _distrust(self, n: int, got: int) -> None:
        """Decode the compiled range holding n eagerly from now on, saying why once."""
        warnings.warn(f"the compiled decode step returned {got} row(s) for {n}; decoding those "
                      "batch sizes without it", stacklevel=3)  # fmt: skip
        self.compiled = [(rows, range(0) if n in rows else widths, None if n in rows else run)
                         for rows, widths, run in self.compiled]  # fmt: skip

    def _example(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inputs shaped like a decode step's with n running rows (copies: nothing runs on
        them, but the export must not be able to touch the live cache's rows). The width is
        neither 1 nor 2 lest the export specialise on it."""
        cache = self.cache
        width = max(3, min(16, cache.mask.shape[1] - 1))
        ids = torch.zeros(n, 1, dtype=torch.long, device=cache.mask.device)
        return ids, cache.positions[:n, None].clone(), cache.mask[:n, :width].clone()

    def _compiled_for(self, ids, positions, key_mask):
        """The compiled step for these inputs (compiled, or loaded from the cache folder, for the
        range of rows holding theirs when there is none yet); None: decode them eagerly."""
        n, width = key_mask.shape
        for rows, widths, run in self.compiled:
            if n in rows:
                return run if width in widths else None
        try:
            entry = self._entry(n)
            if entry is not None:
                rows, widths = range(*entry["rows"]), range(*entry["widths"])
                run = _load(self.dir / entry["file"], self.step)
                self.counts["loaded"] += 1
            else:
                rows, widths, run = self._compile(ids, positions, key_mask)
                self.counts["compiled"] += 1
        except Exception as err:  # e.g. no C++ compiler, an older torch: decode eagerly
            warnings.warn(f"compiling the decode step failed, decoding without it: {err}",
                          stacklevel=3)  # fmt: skip
            rows, widths, run = range(2**62), range(0), None
        self.compiled.append((rows, widths, run))
        return run if n in rows and width in widths else None

    def _entry(self, n: int) -> dict | None:
        """The cache folder's record of a compiled step whose rows hold n, if any."""
        entries = read_index(self.dir) if self.dir is not None else []
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
        with warnings.catch_warnings(), _parameters_registered_only(self.step):
            # Int8Linear's lazily made GEMM weight: an in-graph cast
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
        # and the weights stay out of the library (_load hands it the model's own)
        configs = {"cpp.dynamic_threads": True, "aot_inductor.package_constants_in_so": False}
        from torch._inductor import aoti_compile_and_package  # the compiler: only to compile

        try:
            aoti_compile_and_package(ep, package_path=str(partial), inductor_configs=configs)
        finally:
            _forget_export_graph()
        os.replace(partial, self.dir / name)
        shapes = [node.meta["val"].shape for node in ep.graph.nodes if node.op == "placeholder"
                  and node.name in ep.graph_signature.user_inputs[:3]]  # fmt: skip
        # no more rows than slots, no wider than the mask: bounds the export may leave open.
        # The rows: those every input's first size allows (the model's branches on its row
        # count constrain the ids' size; the key mask's may be a symbol of its own, unbounded)
        slots, most = self.cache.mask.shape
        rows = [_range(ep, shape[0], slots) for shape in shapes]
        found = range(max(r.start for r in rows), min(r.stop for r in rows))
        widths = _range(ep, shapes[2][1], most)
        add_to_index(self.dir, {"file": name, "rows": [found.start, found.stop],
                                 "widths": [widths.start, widths.stop]})  # fmt: skip
        return found, widths, _load(self.dir / name, self.step)


def _forget_export_graph() -> None:
    """torch keeps the last non-strict export's proxies in a module global (read only by its
    fake-tensor leak report) until the next export, and through them that export's whole graph
    module, on which AOTInductor hangs a copy of every buffer (`gm.meta`): for a GGUF model run
    as stored or a quantised one, whose packed weights are buffers, a model's worth of memory
    kept after the compile. Emptied here (the next export fills it again), and the graphs'
    reference cycles collected and their pages handed back now, not at some later collection."""
    from torch.fx.experimental import proxy_tensor

    getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()
    gc.collect()
    return_freed_memory()


@contextlib.contextmanager
def _parameters_registered_only(module: nn.Module):
    """quantize.call_directly copies each module's parameters into its instance dict (a cheaper
    lookup per call); an export would take those for plain tensors and bake them into the
    library as nameless constants. Hidden while exporting, they are found by name."""
    hidden = [(m, name, m.__dict__.pop(name)) for m in module.modules()
              for name in list(m._parameters) if name in m.__dict__]  # fmt: skip
    try:
        yield
    finally:
        for m, name, tensor in hidden:
            m.__dict__[name] = tensor


def _load(path: Path, step: nn.Module):
    """A compiled package's flat entry point: [ids, positions, key_mask, *k, *v] -> outputs,
    reading the weights from `step`'s own tensors (the package holds none).

    torch's C++ package loader, called directly: torch._inductor.aoti_load_package wraps the
    same class, but importing it imports the compiler, 142 MiB of resident modules that an
    engine loading its steps from the compile cache never runs."""
    model = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
    own = dict(step.named_parameters(remove_duplicate=False))
    own.update(step.named_buffers(remove_duplicate=False))  # tied weights under each name
    wanted = model.get_constant_fqns()
    missing = [name for name in wanted if name not in own]
    if missing:  # the loader would only warn, and the step would read unset memory
        raise RuntimeError(f"the compiled step reads tensors the model lacks: {missing[:3]}")
    # Aliases of the weights' storage, kept by the returned function: the library holds only
    # their addresses (user_managed), and a weight replaced later (`param.data = ...`, a
    # `module.to(dtype)`) would otherwise free the memory it reads. In-place writes still
    # reach it; replaced weights do not (a new engine sees them).
    weights = {name: own[name].detach() for name in wanted}
    # (constants, use_inactive, check_full_update, user_managed: keep our pointers, copy nothing)
    model.load_constants(weights, False, True, True)
    boxed_run = model.boxed_run  # the flat entry point (no input spec parsed per call)

    def run(flat: list[torch.Tensor], _weights=weights) -> list[torch.Tensor]:
        return boxed_run(flat)

    return run


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
