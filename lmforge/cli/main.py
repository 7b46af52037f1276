"""The `lmforge` command: one subcommand per stage, each defined in its own module.

A module in COMMANDS provides `register(subparsers)`, which adds its parser and sets
`func=run(args)`. Every failure a user can cause or meet is one line on stderr, never a
traceback, and all of them are mapped here, in one place:

- bad input (LMForgeError: config, data, checkpoint) and text that is not UTF-8: exit status 2;
- the operating system refusing (a file where a folder is needed, no permission, a full disk,
  a file size limit; safetensors reports the last two as its own error type): exit status 1,
  naming the file (the error's own, else the open file being read or written, else the
  command's output folder).

Ctrl-C (SIGINT) and SIGTERM, which schedulers send before pre-empting a job and torchrun
forwards to its workers, both raise KeyboardInterrupt, so the trainers' interrupt path saves
a checkpoint for `--resume` either way; the exit status is then 128 + the signal number.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import io
import os
import re
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from lmforge.errors import LMForgeError, Terminated, require_device

# the verb modules, `lmforge --help` lists their verbs in this order
COMMAND_NAMES = (
    "pretrain tokenizer generate evaluate rag model_info precision seq2seq classify convert "
    "post_train chat serve vlm checkpoint speedrun"
)
COMMANDS = [f"lmforge.cli.{name}" for name in COMMAND_NAMES.split()]

# What the OS means, in words that say what to fix; other errnos use the OS's own text.
OS_CAUSES = {
    errno.EACCES: "permission denied (read-only, or owned by another user)",
    errno.EPERM: "operation not permitted (read-only, or owned by another user)",
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on device (free some space and run again)",
    errno.EDQUOT: "disk quota exceeded (free some space and run again)",
    errno.EFBIG: "file too large (the file size limit, `ulimit -f`, was reached)",
    errno.ENOENT: "no such file or folder",
    errno.EISDIR: "is a folder, where a file is needed",
}


REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Train, fine-tune, align, serve and evaluate causal transformer LMs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def add_run_parser(
    sub, name: str, config: str, func, help: str, example: str, model: str | None = None,
    lead: str = "", **kw,
) -> argparse.ArgumentParser:  # fmt: skip
    """The parser of a verb that runs a trainer: --config (YAML of the `config` dataclass's
    fields), --resume, and any field as `--key value` (`model` names what `--model.KEY`
    sets); `example` shows overrides in the description."""
    models = f" ({model} fields as --model.KEY value)" if model else ""
    description = f"{lead}Any {config} field can be given as --key value{models}, e.g. {example}."
    p = sub.add_parser(name, help=help, description=description, **kw)
    p.add_argument("--config", help=f"YAML file of {config} fields (optional)")
    p.add_argument("--resume", action="store_true", help="continue from out_dir's saved state")
    p.set_defaults(func=func, accepts_overrides=True)
    return p


def config_from_args(args: argparse.Namespace, cls: type, flags: dict | None = None):
    """The run config of a trainer verb: `cls` from --config's YAML, then the fields the verb's
    own `flags` stand for, then the command line's `--key value` pairs. Its out_dir is recorded
    on args: the folder to name if a write there fails without a file name."""
    from lmforge.train.config import build_config, parse_overrides

    cfg = build_config(cls, args.config, (flags or {}) | parse_overrides(args.overrides))
    args.out_dir = cfg.out_dir
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    with sigterm_as_interrupt() as received:
        try:
            check_device_arg(args)
            return int(args.func(args) or 0)
        except KeyboardInterrupt as err:
            terminated = isinstance(err, Terminated) or received == [signal.SIGTERM]
            return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
        except Exception as err:  # the kinds describe_error knows; others are re-raised
            message, status = describe_error(err, args)
            if message is None:
                raise
            print(f"error: {message}", file=sys.stderr)
            return status


def check_device_arg(args: argparse.Namespace) -> None:
    """A `--device` option (generate, chat, eval, ...) is checked before anything loads, so an
    unknown or absent device is named as such, not reported as a corrupt checkpoint. `auto`
    becomes the device it picks."""
    device = getattr(args, "device", None)
    if isinstance(device, str):
        resolved = require_device(device, "--device")
        if device == "auto":
            args.device = str(resolved)


def describe_error(
    err: Exception, args: argparse.Namespace | None = None
) -> tuple[str | None, int]:
    """(one-line message, exit status) for an error the CLI reports without a traceback, or
    (None, 1) for one it does not know (a bug: the traceback is then what helps)."""
    if isinstance(err, LMForgeError):
        return one_line(str(err)), 2
    if isinstance(err, UnicodeDecodeError):
        where = file_in_traceback(err.__traceback__) or "input"
        bad = err.object[err.start : err.start + 1].hex()
        return one_line(
            f"{where}: not valid {err.encoding} text (byte 0x{bad}: {err.reason}); save it as UTF-8"
        ), 2
    if isinstance(err, OSError):
        where = _path_text(err.filename)
        if where is None:  # failed read()/write() calls carry no name: find the file
            where = file_in_traceback(err.__traceback__) or output_folder(args)
        cause = os_cause(err.errno, err.strerror or str(err), where)
        if err.errno in REFUSED and where is not None and not os.path.lexists(where):
            # creating a file or folder was refused: the folder it was to go in is the one to
            # name (the new name may be an internal temp file the user never chose)
            where, cause = os.path.dirname(os.path.abspath(where)), f"cannot write here: {cause}"
        if err.filename2 is not None:
            where = f"{where} -> {_path_text(err.filename2)}"
        return one_line(f"{where}: {cause}" if where else cause), 1
    if type(err).__name__ == "SafetensorError":  # safetensors' Rust I/O errors (save_file)
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            return None, 1
        number = int(code.group(1))
        cause = f"writing a safetensors file failed: {os_cause(number, os.strerror(number), None)}"
        where = output_folder(args)
        return one_line(f"{where}: {cause}" if where else cause), 1
    return None, 1


def os_cause(number: int | None, text: str, path: str | None) -> str:
    """The cause of an OS error in words; where a file stands where a folder is needed (EEXIST
    from mkdir, ENOTDIR), which part of `path` it is."""
    if number in (errno.EEXIST, errno.ENOTDIR) and path is not None:
        for part in (Path(path), *Path(path).parents):
            if part.exists() and not part.is_dir():
                where = "" if part == Path(path) else f"{part} "
                return f"{where}is a file, where a folder is needed"
    return OS_CAUSES.get(number, text)


def file_in_traceback(tb: TracebackType | None) -> str | None:
    """The name of the file an I/O error happened on, when the error itself does not carry it:
    the innermost frame of the traceback holding a file object with a path as its name (the
    file being decoded or written when read()/write() failed)."""
    frames = [frame for frame, _ in traceback.walk_tb(tb)]
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, io.IOBase):
                name = _path_text(getattr(value, "name", None))
                if name is not None and not name.startswith("<"):  # not <stdin>
                    return name
    return None


def output_folder(args: argparse.Namespace | None) -> str | None:
    """The folder the command writes to (`--out_dir` / `--out`, or a config's out_dir that
    the command recorded on args): the place to name when a write fails without a file name."""
    for key in ("out_dir", "out"):
        value = getattr(args, key, None)
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    return None


def _path_text(name: object) -> str | None:
    """A file name as text; None for none, or for a file descriptor number."""
    if isinstance(name, (str, bytes, os.PathLike)):
        return os.fsdecode(name)
    return None


def one_line(text: str) -> str:
    return " ".join(text.split("\n")).strip()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """While the command runs, SIGTERM stops it the way Ctrl-C does, once: a second signal
    while the checkpoint is being saved is ignored, so the save completes (a scheduler's SIGKILL
    after its grace period stays the hard stop). Processes forked from this one (data workers)
    keep the default action: they just end.

    In a plain process the signal raises Terminated (a KeyboardInterrupt) at once. In a torchrun
    worker, which torchrun sends SIGTERM (or SIGINT, for Ctrl-C at the launcher) when the job is
    stopped, raising at once would leave each rank at a different point of a step, and their
    checkpoint collectives would not match (the save hangs until torchrun kills it): there
    SIGTERM and SIGINT only ask for a stop, which all ranks take together at the next step's
    all-reduce (lmforge.train.stop.request_stop). Yields the list of the signal taken."""
    from lmforge.train.parallel import launched_by_torchrun
    from lmforge.train.stop import handling_signals, request_stop

    received: list[int] = []
    deferred = launched_by_torchrun()

    def handler(signum: int) -> None:
        if received:
            return
        received.append(signum)
        if deferred:
            request_stop()
            return
        raise Terminated(f"signal {signum}")

    signums = (signal.SIGTERM, signal.SIGINT) if deferred else (signal.SIGTERM,)
    with handling_signals(signums, handler):
        yield received


if __name__ == "__main__":
    sys.exit(main())
