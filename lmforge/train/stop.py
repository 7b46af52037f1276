"""Stopping a training run cleanly on SIGTERM or Ctrl-C: the request is taken between two steps.

The loop checks `take_stop` at each step boundary, so the checkpoint it saves is the state after
a whole step and a resume continues exactly. Under torchrun the request rides on the step's
all-reduce (`lmforge.train.parallel.DDPParallel.sum` calls `stop_pending` and `agree_stop`), so
every rank stops after the same step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator

# A stop (SIGTERM, Ctrl-C) asked for while the training loop runs. The loop takes it only between
# two steps, so the checkpoint it saves is the state after a whole step and a resume continues
# exactly. Under torchrun each rank gets the signal at its own point in a step, so none stops on
# its own: the request rides on the step's `sum` all-reduce (which every rank runs at the same
# place in every step), and all ranks stop after that same step, then save together.
_stop_requested: int | None = 0  # the signal asked for (0: none); None: taken, later ones ignored
_stop_agreed = False  # under torchrun: some rank asked, seen by all in the last `sum`


def request_stop(signum: int = signal.SIGINT) -> None:
    """Ask the training loop to stop after the current step (signal handlers call this)."""
    global _stop_requested
    if _stop_requested == 0:
        _stop_requested = signum


def stop_pending() -> bool:
    """Whether a stop was asked for and not yet taken: a second signal then means now, and
    under torchrun it is the flag a rank adds to the step's all-reduce."""
    return bool(_stop_requested)


def reset_stop() -> None:
    """Forget earlier requests (a training run starts listening afresh)."""
    global _stop_requested, _stop_agreed
    _stop_requested, _stop_agreed = 0, False


def take_stop(world_size: int) -> int | None:
    """At a step boundary: the signal to stop for, or None. Under torchrun only a request every
    rank saw (through the step's all-reduce) counts, so all ranks stop after the same step. Once
    taken, later requests are ignored: they must not interrupt the checkpoint save."""
    global _stop_requested
    if not (_stop_agreed if world_size > 1 else _stop_requested):
        return None
    signum = _stop_requested or signal.SIGINT
    _stop_requested = None
    return signum


@contextlib.contextmanager
def handling_signals(signums: tuple[int, ...], handler: Callable[[int], None]) -> Iterator[None]:
    """While the body runs, `handler(signum)` takes each of `signums` in this process; a process
    forked from it (a data worker) that inherits the handler dies by the signal's default action
    instead. Only the main thread can install handlers: in another thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def on_signal(signum, frame) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        handler(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in signums}
    try:
        yield
    finally:
        for signum, action in previous.items():
            signal.signal(signum, action)


def agree_stop(seen: bool) -> None:
    """Record that some rank asked to stop (seen in the step's all-reduce): all ranks stop."""
    global _stop_agreed
    _stop_agreed = _stop_agreed or seen
