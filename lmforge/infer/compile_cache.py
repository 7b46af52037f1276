"""The compile cache of the CPU's exported decode steps (steps.ExportedStep): one folder per key
(what a compiled step depends on, `cache_key`), an index of the packages in it by range of rows,
and a bound on the whole cache (`prune_compile_cache`). A package loaded from here is a shared
library run in this process, so the folder must be the user's own (steps.ExportedStep.use_cache_dir
says why it is safe)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import torch
from torch import nn

from lmforge.infer.cpu_features import cpu_features
from lmforge.model.cache import SlotCache

INDEX = "index.json"


def read_index(folder: Path) -> list[dict]:
    """The packages recorded in folder's index: {"file", "rows", "widths"} each."""
    try:
        entries = json.loads((folder / INDEX).read_text())["entries"]
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: compile again
        return []
    return [e for e in entries if isinstance(e, dict) and {"file", "rows", "widths"} <= set(e)]


def add_to_index(folder: Path, entry: dict) -> None:
    """Record a package (replacing the one for the same rows), atomically."""
    entries = [e for e in read_index(folder) if e["rows"] != entry["rows"]] + [entry]
    partial = folder / f".{INDEX}.{os.getpid()}.partial"
    partial.write_text(json.dumps({"entries": entries}, indent=1))
    os.replace(partial, folder / INDEX)


# The most the compile cache keeps. Every new model, dtype, cache shape, torch or lmforge source
# makes a new key folder, so without a bound the folders of models and versions no longer run
# pile up.
COMPILE_CACHE_BYTES = 4 << 30


def prune_compile_cache(root: Path, keep: Path, limit: int = COMPILE_CACHE_BYTES) -> list[Path]:
    """Delete root's least recently used key folders (never `keep`) until what is left fits in
    `limit` bytes; returns the folders deleted. An engine that loaded a package keeps running
    it: the library is mapped, and deleting its file does not unmap it."""

    def size(folder: Path) -> int:
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

    try:
        folders = sorted((f for f in root.iterdir() if f.is_dir() and f != keep),
                         key=lambda f: f.stat().st_mtime)  # fmt: skip
        sizes = {f: size(f) for f in [*folders, keep]}
    except OSError:  # unreadable or changing under us: keep everything
        return []
    total, deleted = sum(sizes.values()), []
    for folder in folders:
        if total <= limit:
            break
        shutil.rmtree(folder, ignore_errors=True)
        total -= sizes[folder]
        deleted.append(folder)
    return deleted


def cache_key(step: nn.Module, cache: SlotCache) -> str:
    """What a compiled step depends on, hashed: the weights' names, dtypes and shapes (not their
    values: the library reads them from the model, so a fine-tuned model of the same shape
    reuses it), the KV cache's shapes (static inputs), the source of every
    module the step runs (a changed lmforge recompiles), the torch version and the CPU (the
    library's vector ISA: a package built with AVX-512 would crash on an AVX2 host; Inductor
    picks it from the CPU's flags and torch's dispatch level, ATEN_CPU_CAPABILITY included)."""
    cpu = cpu_features()
    digest = hashlib.sha256()
    modules = {type(m).__module__ for m in step.modules()} | {__name__, type(cache).__module__}
    sources = {name: _source_hash(name) for name in sorted(modules)}
    meta = {
        "torch": torch.__version__,
        "isa": [cpu.capability, sorted(cpu.flags)],
        "cpu": [platform.machine(), cpu.model],
        "kv": [[list(t.shape), str(t.dtype)] for t in (*cache.k, *cache.v)],
        "mask": [list(cache.mask.shape), str(cache.positions.dtype)],
        "sources": sources,
    }
    digest.update(json.dumps(meta, sort_keys=True).encode())
    for name, tensor in sorted(step.state_dict(keep_vars=False).items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
    return digest.hexdigest()[:24]


@functools.cache
def _source_hash(module: str) -> str:
    """The hash of a module's source, read once per process: the file may be edited while a
    server runs, but the code that runs (and that a compiled step was made from) stays."""
    try:
        return hashlib.sha256(inspect.getsource(sys.modules[module]).encode()).hexdigest()
    except (OSError, TypeError, KeyError):  # no source file (e.g. a frozen build)
        return "?"
