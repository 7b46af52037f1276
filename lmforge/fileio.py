"""Atomic file writes and careful reads: a crash mid-save never leaves a half-written file, and a
bad file produces one message naming it."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import socket
import stat
import tempfile
import time
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmforge.errors import CheckpointError, ConfigError, DataError, LMForgeError

# ---- temporary files and their clean-up ------------------------------------------------------
# A temp file is `.NAME.lmf-HOST-PID.RANDOM.tmp`: hidden, beside its target, and naming the host and
# process that writes it, so a later run can tell an orphan (its writer was killed, e.g. SIGKILL
# mid-save, and no `except` ever ran) from a file another live process is still writing.
TEMP_SUFFIX = ".tmp"
_TEMP_TAG = re.compile(r"\.lmf-(?P<host>[A-Za-z0-9-]*)-(?P<pid>\d+)\.[^.]+\.tmp$")
# An owner-tagged temp of this host whose writer is dead is removed once it is this old: the grace
# covers a writer in another PID namespace that shares this host name and folder (a container),
# whose PID we cannot see; a live writer's file is fresh because atomic writes never pause.
DEAD_WRITER_GRACE_S = 60.0
# Any `.*.tmp` untouched this long is removed whoever wrote it (another host's writer whose PID
# cannot be checked, an untagged temp, a reused PID): every writer here streams its temp and
# renames it within one save, so a day without a write means nobody is writing it.
UNOWNED_TEMP_AGE_S = 24 * 3600.0


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40]


def temp_file_beside(path: str | Path) -> tuple[int, str]:
    """mkstemp for an atomic write of `path`: (fd, name) of a new hidden temp file in path's
    folder whose name records this host and PID, so `remove_stale_temps` can remove it if this
    process dies before renaming it. Every atomic writer should create its temp file here."""
    path = Path(path)
    prefix = f".{path.name}.lmf-{_host_tag()}-{os.getpid()}."
    return tempfile.mkstemp(prefix=prefix, suffix=TEMP_SUFFIX, dir=path.parent)


def _pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host and is not a zombie (a killed child that its
    parent has not reaped yet writes nothing). Unknown answers count as alive."""
    if pid == os.getpid() or pid <= 0 or not hasattr(os, "kill"):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by another user
        return True
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
        return proc_stat[proc_stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return True


def remove_stale_temps(folder: str | Path, now: float | None = None) -> list[Path]:
    """Delete the temp files that killed writers left in `folder` (not recursive) and return
    them. Only our naming pattern `.*.tmp` is considered, and only files nobody is writing:
    an owner-tagged temp of this host whose process is gone (and at least DEAD_WRITER_GRACE_S
    old), or any such temp unmodified for UNOWNED_TEMP_AGE_S. Call it when a run opens the folder
    it writes to, so SIGKILLed saves do not pile up full-size orphans. Errors are ignored: a
    file that vanished or cannot be removed is another process's business."""
    now = time.time() if now is None else now
    host = _host_tag()
    removed = []
    for path in Path(folder).glob(f".*{TEMP_SUFFIX}"):  # a missing folder has none
        with contextlib.suppress(OSError):  # vanished, or not ours to remove
            info = path.lstat()
            age, tag = now - info.st_mtime, _TEMP_TAG.search(path.name)
            stale = age > UNOWNED_TEMP_AGE_S
            if not stale and tag and tag["host"] == host:
                stale = age > DEAD_WRITER_GRACE_S and not _pid_alive(int(tag["pid"]))
            if stale and stat.S_ISREG(info.st_mode):  # a plain file, not a link
                path.unlink()
                removed.append(path)
    return removed


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path) on a temp file beside `path`, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file_beside(path)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def read_text_file(path: str | Path) -> tuple[str | None, str]:
    """(text, "") or (None, reason): binary content (NUL bytes) and bad UTF-8 are refused."""
    data = Path(path).read_bytes()
    if b"\x00" in data[:8192]:
        return None, "binary"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 at byte {e.start}"


def write_json(path: str | Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def read_json(
    path: str | Path, what: str = "JSON file", error: type[LMForgeError] = CheckpointError
) -> Any:
    """A JSON file's content; a missing or malformed file raises `error` naming it."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise error(f"{path}: invalid JSON ({err})") from err


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata=None) -> None:
    """safetensors, atomically. Tensors are made contiguous and detached from autograd."""
    clean = {k: v.detach().contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(clean, tmp, metadata=metadata))


# safetensors' format (huggingface/safetensors README): an 8-byte little-endian header length,
# a JSON header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then
# the data, offsets relative to its start. The Rust reader caps the header at 100 MB.
SAFETENSORS_MAX_HEADER = 100_000_000
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
    "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def check_safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked before any tensor is read: its length
    within the file and the format's 100 MB cap, every entry a known dtype with a shape of
    non-negative integers whose byte count equals its data_offsets span, every span inside the
    file and no two overlapping. A truncated, garbage or hostile file raises one CheckpointError
    line naming the file and the field; memory stays bounded by the file's real size."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights file not found: {path}")
    size = path.stat().st_size

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: corrupt or truncated safetensors file ({what})")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, SAFETENSORS_MAX_HEADER):
            raise bad(f"header length {n} exceeds the file's {size - 8} remaining bytes or "
                      f"the format's {SAFETENSORS_MAX_HEADER}")  # fmt: skip
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise bad(f"header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data = size - 8 - n
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise bad(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPE_BYTES:
            raise bad(f"tensor {name!r}: unknown dtype {dtype!r}")
        # type(x) is int, not isinstance: JSON true / false are not sizes
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
        pair = isinstance(offsets, list) and [type(o) for o in offsets] == [int, int]
        if not (pair and 0 <= offsets[0] <= offsets[1] <= data):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r} outside the {data} data bytes")
        count = 1
        for d in shape:  # bounded at every step: huge claimed shapes stop here
            count *= d
            if count > data:
                break
        if count * SAFETENSORS_DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
            raise bad(f"tensor {name!r}: {dtype} {shape} does not fill data_offsets {offsets}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise bad(f"tensors {a!r} and {b!r} overlap")
    return header


def load_tensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load a safetensors file; a missing, truncated or corrupt file raises CheckpointError."""
    path = Path(path)
    check_safetensors_header(path)
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({err})") from err


def check_state(
    path: str | Path, found: dict, expected: dict, source: str = "config.json", allowed=()
) -> None:
    """CheckpointError unless the weights file `path` holds (`found`) exactly the tensors
    `expected` names, plus any of `allowed`, each with the shape `source` (config.json, the GGUF
    metadata) implies. `found` and `expected` map names to tensors or to shapes."""
    if missing := sorted(set(expected) - set(found)):
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}")
    if unexpected := sorted(set(found) - set(expected) - set(allowed)):
        raise CheckpointError(
            f"{path}: unexpected tensor(s) {', '.join(unexpected[:5])} ({source} has no place "
            "for them)"
        )
    for name, want in expected.items():
        have, want = (tuple(getattr(x, "shape", x)) for x in (found[name], want))
        if have != want:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {have}, {source} implies {want}"
            )


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping; errors name the file and line."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: invalid YAML ({getattr(err, 'problem', err)})") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values at the top level")
    return data


def coerce_numbers(cls, data: dict[str, Any], source: str) -> dict[str, Any]:
    """YAML 1.1 reads `1e-3` as a string: convert strings for numeric fields, naming bad ones."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        hint = str(hints.get(key, ""))
        if not isinstance(value, str) or "str" in hint:
            continue
        for kind in (int, float):
            if kind.__name__ in hint:
                try:
                    out[key] = kind(value)
                    break
                except ValueError:
                    continue
        else:
            raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
    return out


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file (.gz allowed).

    Every data loader uses this, so a bad line is always reported as `file:line`.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{line_no}: invalid JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_no}: expected a JSON object")
            yield line_no, row


def read_rows(
    path: str | Path,
    check: Callable[[dict[str, Any], str], dict[str, Any]],
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """The first `limit` (default all) rows of a JSONL file, each as `check(row, "file:line")`
    returns it (raising DataError naming the line when it is bad); a file without rows is a
    DataError too."""
    rows = []
    for line_no, row in read_jsonl(path):
        rows.append(check(row, f"{path}:{line_no}"))
        if limit is not None and len(rows) >= limit:
            break
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def cache_root() -> Path:
    """lmforge's cache folder: $LMFORGE_CACHE, else ~/.cache/lmforge (task files, built kernels)."""
    return Path(os.environ.get("LMFORGE_CACHE") or Path.home() / ".cache" / "lmforge")
