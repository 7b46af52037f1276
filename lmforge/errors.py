"""Exceptions for bad input, so the CLI can print one readable line instead of a traceback,
and the small checks that raise them."""

from __future__ import annotations

import math
import types
import typing
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class LMForgeError(Exception):
    """Bad input (config, data, checkpoint, request). The message names what is wrong."""


class ConfigError(LMForgeError, ValueError):
    """An invalid or inconsistent configuration value."""


class DataError(LMForgeError, ValueError):
    """A missing, empty or malformed data file."""


class CheckpointError(LMForgeError, ValueError):
    """A missing, corrupt or mismatched checkpoint."""


class NonFiniteLoss(LMForgeError):
    """A training loss became NaN or inf. The training loop raises it before the optimizer
    step, so neither the weights nor the optimizer state saw it; the last good checkpoint is
    kept."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be: every `except
    KeyboardInterrupt` (the training loop's save-and-stop path) handles it the same way, and the
    CLI exits with 128 + SIGTERM."""


def require_int(name: str, value: Any, low: int = 1) -> None:
    """Raise ConfigError naming `name` unless `value` is an integer >= `low` (booleans do not
    count as integers)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ConfigError(f"{name} must be {what}, got {value!r}")


def require_positive_ints(obj: object, *names: str) -> None:
    """`require_int` for each of `names` on `obj` (a config dataclass)."""
    for name in names:
        require_int(name, getattr(obj, name))


def require_choice(name: str, value: Any, choices: typing.Iterable[str]) -> None:
    """Raise ConfigError if `value` is not one of `choices` (a registry's keys, a tuple of
    names), naming the field `name` and listing the choices."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_field_types(cls: type, data: dict[str, Any], source: str) -> dict[str, Any]:
    """Check `data` (keyword arguments for the dataclass `cls`) against its field annotations
    before `cls(**data)` runs, so `--grad_clip '[1]'` or `lr: .nan` fails naming the field
    instead of deep inside training. Float fields must be finite; int fields take integral
    floats (YAML reads `1e4` as one); str fields take numbers, returned as text (YAML reads
    `--out_dir 2024` as an int). Returns the data with those conversions applied."""
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        if (hint := hints.get(key)) is None:
            continue
        ok = _accepts(hint, value)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if ok is False and number and _accepts(hint, ""):
            out[key] = str(value)
        elif ok is False:
            raise ConfigError(f"{source}: {key} must be {_describe(hint)}, got {value!r}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: {key} must be a finite number, got {value!r}")
    return out


def _accepts(hint: Any, value: Any) -> bool | None:
    """Whether `value` fits the annotation `hint`; None where the annotation is not one of the
    simple kinds config dataclasses use (then the dataclass's own checks decide)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        answers = [_accepts(arg, value) for arg in typing.get_args(hint)]
        return True if True in answers else None if None in answers else False
    if hint is type(None):
        return value is None
    base = typing.get_origin(hint) or hint
    if base is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):  # bool is an int subclass: `True` is not a number here
        return False
    if base is int:
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if base is float:
        return isinstance(value, (int, float))
    if base in (str, dict, list, tuple):
        return isinstance(value, base)
    return None


def _describe(hint: Any) -> str:
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
             dict: "a mapping", list: "a list", tuple: "a list", type(None): "null"}  # fmt: skip
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    return names.get(typing.get_origin(hint) or hint, str(hint))


def require_text(text: str, what: str) -> str:
    """Return `text` if it can be encoded as UTF-8, else raise ConfigError naming `what` (e.g.
    `--prompt`). Python strings can hold lone surrogates (`"\\ud800"`, or undecodable bytes of a
    command line read with surrogateescape) that no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        if 0xDC80 <= code <= 0xDCFF:  # how Python keeps a byte it could not decode
            bad = f"byte 0x{code - 0xDC00:02X}, which is not UTF-8,"
        else:
            bad = f"lone surrogate U+{code:04X}"
        raise ConfigError(
            f"{what}: not valid Unicode text ({bad} at character {err.start}); pass UTF-8 text"
        ) from None
    return text


def require_device(name: str, what: str = "device") -> torch.device:
    """Parse a device name (`auto`, `cpu`, `cuda`, `cuda:1`, `mps`, ...) and check that this
    machine has it: `auto` picks CUDA when available. Raises ConfigError naming `what` for an
    unknown name or a device that is not there, before anything loads or is written."""
    import torch

    if not isinstance(name, str):
        raise ConfigError(f"{what} must be a device name such as cpu or cuda, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(
            f"{what}: unknown device {name!r} (expected auto, cpu, cuda, cuda:N or mps)"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{what}: {name!r} requested but no CUDA GPU is available to this torch "
                "(use --device cpu or auto)"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{what}: {name!r} requested but only {torch.cuda.device_count()} CUDA "
                "device(s) are visible"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{what}: 'mps' requested but MPS is not available on this machine")
    return device
