"""Progress reporting fit for a terminal and for a log file.

On a terminal, `progress_bar` is a tqdm bar. When stderr is not a terminal (a redirected log, a
batch job), a bar's carriage-return redraws pile up as thousands of updates in one line of the
file; there it is `PlainProgress` instead: one plain, complete line every `interval` seconds
(and one at the end), e.g. `pretraining: 250/2000 it, 12.5 it/s, 02:20 left, loss=1.982`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

PLAIN_INTERVAL_S = 5.0  # seconds between two plain progress lines


class PlainProgress(tqdm):
    """A tqdm bar (update, set_postfix, write, close, iteration, `with`) that writes a plain
    line every `interval` seconds (`clock`'s) and one at the end, instead of redrawing itself."""

    def __init__(self, iterable=None, *, interval=PLAIN_INTERVAL_S, clock=time.monotonic, **kwargs):
        # the first line after `interval` too (delay); no line is cleared at the end (leave)
        kwargs.update(mininterval=interval, delay=interval, miniters=1, leave=False)
        super().__init__(iterable, **kwargs)
        self._time, self.printed_n = clock, None
        self.start_t = self.last_print_t = clock()

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing its bar: a log has none
            return False
        self.printed_n = self.n
        print(self.line(), file=self.fp, flush=True)
        return True

    def set_postfix(self, ordered_dict=None, refresh: bool = False, **kwargs: Any) -> None:
        """Metrics appended to the next line, as `key=value` (not a line of their own)."""
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def write(self, line: str) -> None:
        """A message on its own line, in this bar's file (tqdm.write's goes to stdout)."""
        if not self.disable:
            print(line, file=self.fp, flush=True)

    def close(self) -> None:
        """The final line (once), unless nothing moved since the last one."""
        if not self.disable and self.printed_n != self.n:
            self.display()
        super().close()

    def line(self) -> str:
        """The progress line as of now."""
        elapsed = max(self._time() - self.start_t, 1e-9)
        n, total, unit = self.n, self.total, self.unit
        rate = (n - self.initial) / elapsed
        parts = [f"{n}/{total} {unit}" if total else f"{n} {unit}", f"{rate:.3g} {unit}/s"]
        if total and rate > 0 and n < total:
            parts.append(f"{self.format_interval((total - n) / rate)} left")
        else:
            parts.append(f"{self.format_interval(elapsed)} elapsed")
        if self.postfix:
            parts.append(self.postfix)
        return (f"{self.desc}: " if self.desc else "") + ", ".join(parts)


def progress_bar(iterable: Iterable | None = None, *, file: TextIO | None = None, **kwargs: Any):
    """A tqdm bar when `file` (default stderr) is a terminal, else a `PlainProgress` printing a
    line every `interval` seconds. Use it wherever lmforge shows progress; `kwargs` are
    tqdm's (total, desc, unit, initial, disable) and `interval`."""
    file = file if file is not None else sys.stderr
    if hasattr(file, "isatty") and file.isatty():
        kwargs.pop("interval", None)
        return tqdm(iterable, dynamic_ncols=True, file=file, **kwargs)
    return PlainProgress(iterable, file=file, **kwargs)
