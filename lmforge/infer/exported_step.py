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
each compile once (~20 s) on first use; a shape outside every range (the very last cache
column, for some models) runs eagerly, as does everything if compiling fails (no C++ compiler).
Covers decoder.FastDecoder on CPU without dynamic RoPE scaling; the engine uses torch.compile
(compiled_step.py) elsewhere. The weights are copied into each compiled step when it compiles:
build a new engine after changing them.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import torch
from torch import nn

from lmforge.infer.batch import SlotCache
from lmforge.infer.decoder import FastDecoder, fixed_step_unsupported


def exportable(forward, device: torch.device) -> bool:
    """Whether ExportedDecodeStep covers this forward on this device."""
    return device.type == "cpu" and fixed_step_unsupported(forward) is None


class _CacheView:
    """What FastDecoder needs of a cache, built from the exported step's inputs: the running
    rows' key mask [n, length + 1] (its width carries the cache length) and the KV buffers."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], key_mask: torch.Tensor):
        self.k, self.v, self.key_mask = k, v, key_mask
        self.length = key_mask.shape[1] - 1

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        n, end = k_new.shape[0], self.length + 1
        k, v = self.k[layer], self.v[layer]
        k[:n, :, self.length : end] = k_new
        v[:n, :, self.length : end] = v_new
        return k[:n, :, :end], v[:n, :, :end]

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
    first need."""

    def __init__(self, decoder: FastDecoder, cache: SlotCache):
        self.step, self.cache = _Step(decoder), cache
        self.compiled: list[tuple[range, range, object]] = []  # (rows, widths, model)
        self._dir = tempfile.TemporaryDirectory(prefix="lmforge-aoti-")

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

    def _compiled_for(self, n, width, *example):
        for rows, widths, run in self.compiled:
            if n in rows:
                return run if width in widths else None
        try:
            rows, widths, run = self._compile(*example)
        except Exception as err:  # e.g. no C++ compiler, an older torch: decode eagerly
            warnings.warn(f"compiling the decode step failed, decoding without it: {err}",
                          stacklevel=3)  # fmt: skip
            rows, widths, run = range(2**62), range(0), None
        self.compiled.append((rows, widths, run))
        return run if n in rows and width in widths else None

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
        path = os.path.join(self._dir.name, f"decode_{len(self.compiled)}.pt2")
        path = torch._inductor.aoti_compile_and_package(ep, package_path=path)
        with warnings.catch_warnings():  # torch-internal deprecation noise on loading
            warnings.simplefilter("ignore", FutureWarning)
            model = torch._inductor.aoti_load_package(path)
        # The flat entry point: the model's __call__ parses its input spec (JSON) every call.
        run = getattr(getattr(model, "loader", None), "boxed_run", None)
        run = run or (lambda flat: list(model(*flat[:3], flat[3 : 3 + len(k)], flat[3 + len(k) :])))
        dims = next(node for node in ep.graph.nodes if node.op == "placeholder" and
                    node.name == ep.graph_signature.user_inputs[2]).meta["val"].shape  # fmt: skip
        return _range(ep, dims[0]), _range(ep, dims[1]), run


def _range(ep, size) -> range:
    """The values an exported input size may take (a static size: just itself)."""
    expr = size.node.expr if isinstance(size, torch.SymInt) else size
    if expr not in ep.range_constraints:  # static, or fixed by the code (e.g. all slots full)
        return range(int(expr), int(expr) + 1)
    bounds = ep.range_constraints[expr]
    upper = int(bounds.upper) if bounds.upper.is_finite else 2**62
    return range(int(bounds.lower), upper + 1)
