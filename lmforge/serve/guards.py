"""What stands between a client and the routes: limits on who, how much and how slowly.

Every rule that does not depend on a route lives here, applied by one ASGI middleware
(`RequestGuard`) in front of the whole app, so the API, /docs and /openapi.json get the same
checks in the same order:

1. Host: a key-less server on loopback answers only requests addressed to localhost, 127.0.0.1 or
   [::1] (421 otherwise). A web page on another site can point its own DNS name at 127.0.0.1
   (DNS rebinding) and then read a local server's answers as same-origin; the Host header it
   sends still names the attacker's domain.
2. API key: with a key, every path but /health and the chat page needs `Bearer KEY` (401).
3. Body: a Content-Length over `max_body_bytes` is refused (413) before a byte of the body is
   read; a body without one (chunked) is refused as soon as it grows past the limit. The whole
   body must arrive within `read_timeout` seconds (408), however it trickles in. The body is read
   here and handed to the route from memory; 413 and 408 close the connection so nothing more of
   the body is read.

`Admission` bounds the work a server holds (429 with Retry-After past it), and
`uvicorn_config` gives uvicorn a deadline for request heads (see `_H11HeadTimeout`), which it
does not have by itself.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from lmforge.serve import DEFAULT_KEEP_ALIVE_TIMEOUT, DEFAULT_READ_TIMEOUT

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
OPEN_PATHS = ("/health",)  # besides the chat page: "/" and its /static files


class APIError(Exception):
    """An error the client caused (or should know about), rendered OpenAI-style (`response`).
    Every refusal of the server, from the guards below to the routes, is one of these."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type,
        )  # fmt: skip
        self.headers = headers

    def body(self) -> dict:
        """The OpenAI error body {"error": {"message", "type", "param", "code"}}."""
        fields = ("message", "type", "param", "code")
        return {"error": {name: getattr(self, name) for name in fields}}

    def response(self) -> Response:
        # ASCII-escaped JSON: an error may quote client text, which can hold lone surrogates
        # that UTF-8 cannot encode (JSONResponse's rendering would turn a 400 into a 500).
        return Response(json.dumps(self.body()), self.status, self.headers, "application/json")


class Admission:
    """Bounds the samples a server holds: at most `max_batch` decode together and `max_queue`
    more wait for a slot; a request that would go past that gets 429 and Retry-After at once,
    instead of a wait that grows with every client. Counted in samples (n per request), taken by
    the route (`admit`, which knows n) and given back by `RequestGuard` when the request's
    response has ended, however it ended (finished, client gone, error)."""

    def __init__(self, max_batch: int, max_queue: int):
        self.limit = max_batch + max_queue
        self.max_queue = max_queue
        self.active = 0

    def admit(self, scope: Scope, n: int) -> None:
        if self.active + n > self.limit:
            raise APIError(
                429, f"the server is busy: {self.active} samples are running or queued and at "
                f"most {self.max_queue} may wait for a batch slot; retry shortly",
                code="queue_full", headers={"Retry-After": "1"},
            )  # fmt: skip
        self.active += n
        state = scope.setdefault("state", {})
        state["admitted"] = state.get("admitted", 0) + n

    def release(self, scope: Scope) -> None:
        self.active -= scope.get("state", {}).pop("admitted", 0)


def host_allowed(host: str | None) -> bool:
    """Whether a Host header names this machine's loopback (any port). No header: HTTP/1.0
    clients, never a browser, so nothing a rebinding page could send."""
    if host is None:
        return True
    host = host.strip().lower()
    name = host[: host.find("]") + 1] if host.startswith("[") else host.split(":", 1)[0]
    return name in LOCAL_NAMES


def _header(scope: Scope, name: bytes) -> str | None:
    """The first value of header `name` (lower-case bytes, as ASGI gives them)."""
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == name), None)


class RequestGuard:
    """The ASGI middleware applying the checks in the module docstring, in that order."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, check_host: bool,
                 max_body_bytes: int, read_timeout: float, admission: Admission):  # fmt: skip
        self.app, self.api_key, self.check_host = app, api_key, check_host
        self.max_body_bytes, self.read_timeout = max_body_bytes, read_timeout
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self.check_head(scope)
            body = await self.read_body(receive)
        except APIError as refusal:
            return await refusal.response()(scope, receive, send)
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.admission.release(scope)

    def check_head(self, scope: Scope) -> None:
        """Refuse a request on its head alone (host, key, declared size)."""
        host = _header(scope, b"host")
        if self.check_host and not host_allowed(host):
            message = (
                f"Host {host!r} is not served: without an API key this server answers "
                "only localhost, 127.0.0.1 and [::1] (DNS-rebinding protection)"
            )
            raise APIError(421, message, code="host_not_allowed")
        path = scope["path"]
        open_path = path in OPEN_PATHS or path == "/" or path.startswith("/static/")
        if self.api_key is not None and not open_path:
            header = _header(scope, b"authorization") or ""
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                raise APIError(401, "invalid or missing API key", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        length = _header(scope, b"content-length")
        if length is not None and not length.strip().isdigit():
            raise APIError(400, f"invalid Content-Length {length!r}")
        if length is not None and int(length) > self.max_body_bytes:
            raise self.too_large()

    def too_large(self) -> APIError:
        message = f"the request body is larger than {self.max_body_bytes} bytes"
        return APIError(413, message, code="request_too_large", headers={"Connection": "close"})

    async def read_body(self, receive: Receive) -> bytes:
        """The whole body, within the size limit and the read deadline."""
        body = bytearray()
        try:
            async with asyncio.timeout(self.read_timeout):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # client gone: the route will see it
                        return bytes(body)
                    body += message.get("body", b"")
                    if len(body) > self.max_body_bytes:
                        raise self.too_large()
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            message = f"the request body did not arrive within {self.read_timeout:g} s"
            headers = {"Connection": "close"}
            raise APIError(408, message, code="request_timeout", headers=headers) from None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands over the already-read body first, then waits on the client
    (disconnect) as the original does."""
    unsent = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return unsent.pop() if unsent else await receive()

    return replay


class _H11HeadTimeout(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for request heads: from connecting, or from the
    end of the previous response, a client has `head_timeout` seconds to send a complete request
    line and headers, or the connection is closed. uvicorn waits forever for a head that
    trickles in (slowloris); its keep-alive timeout covers only a silent socket after a response.
    """

    head_timeout = DEFAULT_READ_TIMEOUT
    _head_timer: asyncio.TimerHandle | None = None
    _head_cycle = None  # the cycle current when the timer was armed

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._head_cycle:
            self._disarm()  # a new request's head is complete: its cycle exists

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():  # no pipelined request
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_cycle = self.cycle
        # (closing a transport that is already closing does nothing)
        self._head_timer = self.loop.call_later(self.head_timeout, self.transport.close)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 8000,
                   read_timeout: float = DEFAULT_READ_TIMEOUT,
                   keep_alive_timeout: float = DEFAULT_KEEP_ALIVE_TIMEOUT,
                   log_level: str = "warning"):  # fmt: skip
    """The uvicorn.Config `lmforge serve` runs: the h11 protocol with the head deadline
    (`read_timeout`), idle keep-alive connections closed after `keep_alive_timeout` seconds."""
    import uvicorn

    protocol = type("H11Protocol", (_H11HeadTimeout,), {"head_timeout": read_timeout})
    return uvicorn.Config(app, host=host, port=port, http=protocol, log_level=log_level,
                          timeout_keep_alive=keep_alive_timeout)  # fmt: skip
