"""Token shards: documents -> one flat token stream (EOS after each document) on disk, split into
train.bin / val.bin (raw uint16 or uint32, nanoGPT's format) plus meta.json, and read back as a
read-only memory map so a corpus larger than RAM trains fine.

Building streams too: documents are read lazily, tokenized a batch at a time (optionally by
several worker processes, results written in input order) and appended to disk, so memory
depends on the batch size and worker count, never on the corpus size.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data.corpus import TEXT_SUFFIXES, read_documents
from lmforge.errors import ConfigError, DataError, require_choice, require_int
from lmforge.fileio import read_json, remove_stale_temps, temp_file_beside, write_json
from lmforge.progress import progress_bar
from lmforge.tokenizer import Tokenizer

SHARD_FORMAT_VERSION = 1
TOKEN_DTYPES = ("uint16", "uint32")


def shard_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype that holds every id: uint16 up to 65536 ids, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def _batched(items: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


def _split_point(total: int, doc_ends: np.ndarray, val_fraction: float, split_by: str) -> int:
    """Number of tokens that go to train."""
    n_train = int(total * (1 - val_fraction))
    if split_by == "tokens" or val_fraction == 0:
        return n_train
    # split_by == "documents": snap to the document boundary nearest the token split point, but
    # keep at least one document on each side. doc_ends is sorted (and may be a memmap), so a
    # binary search finds the neighbours without reading it all.
    if len(doc_ends) < 2:
        raise DataError("split_by='documents' needs at least two documents; use split_by='tokens'")
    candidates = doc_ends[:-1]
    i = int(np.searchsorted(candidates, n_train))
    near = [int(candidates[j]) for j in (i - 1, i) if 0 <= j < len(candidates)]
    return min(near, key=lambda end: abs(end - n_train))  # ties -> the earlier boundary


def _flatten(encoded: list[list[int]], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(all ids in one array, one length per document)."""
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    ids = itertools.chain.from_iterable(encoded)
    return np.fromiter(ids, dtype=dtype, count=int(lengths.sum())), lengths


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Tokenizer, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    _WORKER.update(tokenizer=tokenizer, dtype=dtype)


def _encode_in_worker(batch: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _flatten(_WORKER["tokenizer"].encode_batch(batch, add_eos=True), _WORKER["dtype"])


def _encoded_batches(
    batches: Iterable[list[str]], tokenizer: Tokenizer, dtype: str, workers: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, lengths) per batch, in input order. With workers > 1, batches go to a pool of
    processes (spawned: no forked tokenizer or torch threads) and at most 2 per worker are in
    flight, so a fast reader cannot queue the whole corpus in memory (Pool.imap would)."""
    if workers == 1:
        for batch in batches:
            yield _flatten(tokenizer.encode_batch(batch, add_eos=True), dtype)
        return
    spawn = multiprocessing.get_context("spawn")  # the tokenizer is pickled to each worker once
    with spawn.Pool(workers, _init_worker, (tokenizer, dtype)) as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def build_token_shards(
    documents: Iterable[str],
    tokenizer: Tokenizer,
    out_dir: str | Path,
    val_fraction: float = 0.1,
    split_by: str = "tokens",
    batch_docs: int = 256,
    progress: bool = True,
    extra_meta: dict[str, Any] | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Tokenize `documents` into out_dir/train.bin, val.bin and meta.json; return the meta dict.

    Each document is followed by EOS. The last `val_fraction` of the token stream is validation
    (split_by="tokens", as nanoGPT does), or the split is moved to the nearest document boundary
    (split_by="documents"). Tokens stream to one temp file, so memory stays at one batch of
    documents; the tail is then copied to val.bin and the file truncated into train.bin. Every
    file is renamed into place only when complete, and meta.json is written last: a directory
    with meta.json holds a finished build. `workers` > 1 tokenizes in that many processes; the
    shards are byte-identical to workers=1.
    """
    require_int("workers", workers)
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    require_choice("split_by", split_by, ("tokens", "documents"))
    if tokenizer.eos_id is None:
        raise ConfigError("build_token_shards needs a tokenizer with an 'eos' special token")
    dtype = shard_dtype(tokenizer.vocab_size)
    itemsize = np.dtype(dtype).itemsize
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)  # token/val temps of a build that was killed: corpus-sized orphans
    (out / "meta.json").unlink(missing_ok=True)  # an interrupted rebuild must not look finished

    # Named temps (host + PID) so a later build can tell a killed build's leftovers from ours.
    fd, tmp = temp_file_beside(out / "train.bin")
    fd_ends, ends_tmp = temp_file_beside(out / "ends.bin")
    val_tmp = None
    try:
        total, n_docs = 0, 0
        batches = _batched((d for d in documents if d), batch_docs)
        with (
            os.fdopen(fd, "wb") as f,
            os.fdopen(fd_ends, "wb") as f_ends,  # document end offsets, on disk too
            progress_bar(desc="tokenizing", unit="doc", disable=not progress) as bar,
        ):
            for flat, lengths in _encoded_batches(batches, tokenizer, dtype, workers):
                f.write(flat.tobytes())
                f_ends.write((total + np.cumsum(lengths)).tobytes())
                total += int(lengths.sum())
                n_docs += len(lengths)
                bar.update(len(lengths))
        if n_docs == 0:
            raise DataError(f"no non-empty documents to tokenize into {out}")
        doc_ends = np.memmap(ends_tmp, dtype=np.int64, mode="r")
        n_train = _split_point(total, doc_ends, val_fraction, split_by)
        del doc_ends

        fd_val, val_tmp = temp_file_beside(out / "val.bin")
        with open(tmp, "r+b") as src, os.fdopen(fd_val, "wb") as dst:
            src.seek(n_train * itemsize)
            shutil.copyfileobj(src, dst, length=1 << 22)
            src.truncate(n_train * itemsize)
        os.replace(tmp, out / "train.bin")
        os.replace(val_tmp, out / "val.bin")
    except BaseException:
        for path in filter(None, (tmp, val_tmp)):
            Path(path).unlink(missing_ok=True)
        raise
    finally:
        Path(ends_tmp).unlink(missing_ok=True)

    meta = {
        "format_version": SHARD_FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "train_tokens": n_train,
        "val_tokens": total - n_train,
        "num_documents": n_docs,
        "val_fraction": val_fraction,
        "split_by": split_by,
        **(extra_meta or {}),
    }
    write_json(out / "meta.json", meta)
    return meta


class TokenShard:
    """A flat array of token ids, normally a read-only memory map of a train.bin/val.bin file."""

    def __init__(self, tokens: np.ndarray, path: Path | None = None, meta: dict | None = None):
        self.tokens, self.path, self.meta = tokens, path, meta or {}

    @classmethod
    def open(cls, path: str | Path, dtype: str | None = None) -> TokenShard:
        """Memory-map a shard file; its dtype comes from meta.json beside it unless given."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"token shard not found: {path}")
        meta_path = path.parent / "meta.json"
        if not meta_path.is_file() and dtype is None:
            raise DataError(f"{path}: no meta.json beside it to give the token dtype")
        meta = read_json(meta_path, "shard meta", DataError) if meta_path.is_file() else {}
        dtype = dtype or meta.get("dtype")
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"{meta_path}: 'dtype' must be one of {TOKEN_DTYPES}, got {dtype!r}")
        size = path.stat().st_size
        itemsize = np.dtype(dtype).itemsize
        if size == 0:
            raise DataError(f"{path}: token shard is empty")
        if size % itemsize:
            raise DataError(
                f"{path}: size {size} bytes is not a multiple of {itemsize} ({dtype}); "
                "the file is truncated or has the wrong dtype"
            )
        return cls(np.memmap(path, dtype=dtype, mode="r"), path, meta)

    @property
    def name(self) -> str:
        """How error messages refer to this shard."""
        return str(self.path) if self.path is not None else "<in-memory shard>"

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"TokenShard({self.name}, tokens={len(self)})"


def _source_stamp(source: str) -> Any:
    """Size and mtime of local source files, so editing the data invalidates the cache."""
    path = Path(source)
    if source.startswith(("builtin:", "hf:")) or not path.exists():
        return None
    if path.is_file():
        st = path.stat()
        return [st.st_size, st.st_mtime_ns]
    files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
    return [[str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def corpus_fingerprint(
    source: str, tokenizer: Tokenizer, val_fraction: float, split_by: str, text_field: str
) -> str:
    """Hash of everything that determines the shards' content."""
    key = {
        "format_version": SHARD_FORMAT_VERSION,
        "tokenizer": hashlib.sha256(tokenizer.backend.to_str().encode()).hexdigest(),
        "source": source,
        "stamp": _source_stamp(source),
        "val_fraction": val_fraction,
        "split_by": split_by,
        "text_field": text_field,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _cached_meta(out: Path, fingerprint: str) -> dict[str, Any] | None:
    """The meta of a finished build in `out` with this fingerprint and intact shards, else None."""
    try:
        meta = json.loads((out / "meta.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("fingerprint") != fingerprint or meta.get("dtype") not in TOKEN_DTYPES:
        return None
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        path = out / f"{split}.bin"
        if not path.is_file() or path.stat().st_size != meta.get(f"{split}_tokens", -1) * itemsize:
            return None
    return meta


def prepare_corpus(
    source: str,
    tokenizer: Tokenizer,
    out_dir: str | Path,
    val_fraction: float = 0.1,
    split_by: str = "tokens",
    text_field: str = "text",
    progress: bool = True,
    workers: int = 1,
) -> dict[str, Any]:
    """read_documents + build_token_shards, skipped when out_dir already holds the same build.

    The cache key (meta.json "fingerprint") covers the tokenizer.json content, the source string
    (plus size/mtime of local files), val_fraction, split_by and text_field.
    """
    source = str(source)
    fingerprint = corpus_fingerprint(source, tokenizer, val_fraction, split_by, text_field)
    if (meta := _cached_meta(Path(out_dir), fingerprint)) is not None:
        return meta
    return build_token_shards(
        read_documents(source, text_field=text_field),
        tokenizer,
        out_dir,
        val_fraction=val_fraction,
        split_by=split_by,
        progress=progress,
        extra_meta={"source": source, "fingerprint": fingerprint},
        workers=workers,
    )
