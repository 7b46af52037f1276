"""AsyncEngine: one background thread steps the Engine; asyncio code awaits per-request outputs.

The model runs in a plain thread (PyTorch releases the GIL inside its kernels), so the event loop
keeps accepting connections and streaming bytes while a step computes. Each step's outputs are
handed to the loop in one `call_soon_threadsafe` and appended to the request's inbox. A consumer
takes everything in its inbox at once: when the loop falls behind the engine (many clients, each
token costing JSON + HTTP work), one chunk carries several tokens instead of the loop paying that
per-token cost again and again, so per-client overhead shrinks exactly when the batch is large,
and a lone client still gets every token as soon as it exists. A
request whose consumer stops early (client disconnect -> task cancelled) is aborted, which frees
its batch slot at the next step. An exception inside a step fails only the requests running at
that moment; the loop resets the engine and keeps serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Sequence

import torch

from lmforge.infer.engine import Engine, GenerationParams, StepOutput

log = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """A step raised; the requests that were running get this instead of more tokens."""


class AsyncEngine:
    """Shares one Engine's batch between many concurrent asyncio callers."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._inboxes: dict[str, _Inbox] = {}
        self._wake = threading.Event()
        self._running = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()

    def start(self) -> None:
        """Start the stepping thread (call from inside the running event loop)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="lmforge-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @torch.inference_mode()  # once for the thread, not per step
    def _run(self) -> None:
        engine = self.engine
        while self._running:
            if not engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs: list = engine.step()
            except Exception as err:  # keep serving: fail the running requests, start clean
                log.exception("engine step failed")
                failed = {s.request_id for s in [*engine.rows, *engine.waiting]}
                engine.reset()
                outputs = [(rid, EngineFailure(f"generation failed: {err}")) for rid in failed]
            if outputs:
                self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list) -> None:
        for out in outputs:
            rid = out[0] if isinstance(out, tuple) else out.request_id
            inbox = self._inboxes.get(rid)
            if inbox is not None:
                inbox.put(out[1] if isinstance(out, tuple) else out)

    async def generate(
        self, prompt: str | Sequence[int], params: GenerationParams, n: int = 1
    ) -> AsyncIterator[list[StepOutput]]:
        """Outputs of all n samples of one request until every one finished, in lists: each
        list is everything produced since the consumer last asked (in order, samples mixed).

        Raises ConfigError (bad prompt/params) before anything is queued.
        """
        rid = f"req-{next(self._ids)}"
        inbox = _Inbox()
        self._inboxes[rid] = inbox
        try:
            self.engine.add_request(prompt, params, n, request_id=rid)
        except BaseException:
            del self._inboxes[rid]
            raise
        self._wake.set()
        remaining = n
        try:
            while remaining:
                outs = await inbox.take()
                failure = next((o for o in outs if isinstance(o, Exception)), None)
                if failure is not None:
                    raise failure
                remaining -= sum(out.finished for out in outs)
                yield outs
        finally:
            self._inboxes.pop(rid, None)
            if remaining:
                self.engine.abort(rid)
                self._wake.set()


class _Inbox:
    """A request's pending outputs; `take` waits for at least one, then returns them all."""

    def __init__(self):
        self.items: list = []
        self.ready = asyncio.Event()

    def put(self, item) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list:
        if not self.items:
            await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items
