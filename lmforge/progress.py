"""Progress reporting fit for a terminal and for a log file.

On a terminal, `progress_bar` is a tqdm bar. When stderr is not a terminal (a redirected log, a
batch job), a bar's carriage-return redraws pile up as thousands of updates in one line of the
file; there it is `PlainProgress` instead: one plain, complete line every `interval` seconds
(and one at the end), e.g. `pretraining: 250/2000 it, 12.5 it/s, 2m20s left, loss=1.982`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

PLAIN_INTERVAL_S = 5.0  # seconds between two plain progress lines


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class PlainProgress:
    """The part of tqdm's interface lmforge uses (update, set_postfix, write, close, iteration,
    `with`), writing a plain line every `interval` seconds instead of redrawing a bar."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str | None = None,
        unit: str = "it",
        initial: int = 0,
        disable: bool = False,
        interval: float = PLAIN_INTERVAL_S,
        file: TextIO | None = None,
        clock=time.monotonic,
    ):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self._start_n = initial
        self.disable, self.interval = disable, interval
        self.file = file if file is not None else sys.stderr
        self._clock = clock
        self._start = self._last = clock()
        self._postfix = ""
        self._closed = False
        self._printed_n: int | None = None

    def __iter__(self) -> Iterator:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_postfix(self, values: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Metrics appended to the next line, as `key=value`."""
        items = {**(values or {}), **kwargs}
        self._postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self._clock()
        if now - self._last >= self.interval:
            self._last = now
            self._print(now)

    def write(self, line: str) -> None:
        """A message on its own line (tqdm.write's counterpart)."""
        if not self.disable:
            print(line, file=self.file, flush=True)

    def close(self) -> None:
        """The final line (once), unless nothing moved since the last one."""
        if not self._closed:
            self._closed = True
            if self._printed_n != self.n:
                self._print(self._clock())

    def line(self, now: float) -> str:
        """The progress line as of `now` (a `clock` reading)."""
        elapsed = max(now - self._start, 1e-9)
        rate = (self.n - self._start_n) / elapsed
        parts = [f"{self.n}/{self.total} {self.unit}" if self.total else f"{self.n} {self.unit}"]
        parts.append(f"{rate:.3g} {self.unit}/s")
        if self.total and rate > 0 and self.n < self.total:
            parts.append(f"{_duration((self.total - self.n) / rate)} left")
        else:
            parts.append(f"{_duration(elapsed)} elapsed")
        if self._postfix:
            parts.append(self._postfix)
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts)

    def _print(self, now: float) -> None:
        if not self.disable:
            self._printed_n = self.n
            print(self.line(now), file=self.file, flush=True)


def progress_bar(iterable: Iterable | None = None, *, file: TextIO | None = None, **kwargs: Any):
    """A tqdm bar when `file` (default stderr) is a terminal, else a `PlainProgress` printing a
    line every `interval` seconds. Use it wherever lmforge shows progress; `kwargs` are
    `PlainProgress`'s (total, desc, unit, initial, disable, interval)."""
    file = file if file is not None else sys.stderr
    if hasattr(file, "isatty") and file.isatty():
        from tqdm import tqdm

        kwargs.pop("interval", None)
        return tqdm(iterable, dynamic_ncols=True, file=file, **kwargs)
    return PlainProgress(iterable, file=file, **kwargs)
