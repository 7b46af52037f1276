"""Atomic file writes and careful reads: a crash mid-save never leaves a half-written file, and a
bad file produces one message naming it."""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lmforge.errors import CheckpointError, ConfigError, DataError


def atomic_write(path: str | Path, write: Callable[[str], None]) -> None:
    """Call write(tmp_path) on a temp file beside `path`, fsync it, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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


def write_json(path: str | Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def read_json(path: str | Path, what: str = "JSON file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: invalid JSON ({err})") from err


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata=None) -> None:
    """safetensors, atomically. Tensors are made contiguous and detached from autograd."""
    clean = {k: v.detach().contiguous() for k, v in tensors.items()}
    atomic_write(path, lambda tmp: save_file(clean, tmp, metadata=metadata))


def load_tensors(path: str | Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Load a safetensors file; a missing, truncated or corrupt file raises CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights file not found: {path}")
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({err})") from err


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
