"""Fixtures: a tiny random model's engine, live servers on 127.0.0.1 (uvicorn in a thread, with
the protocol and timeouts `lmforge serve` uses), and the API key the key-protected one wants."""

import socket
import threading
import time

import pytest

from lmforge.infer.engine import Engine
from lmforge.serve.app import create_app
from lmforge.serve.guards import uvicorn_config

API_KEY = "test-key"
TEXT = "hello there, how are you today? I am fine. The quick brown fox jumps over the lazy dog. "


class LiveServer:
    """uvicorn serving `app` on a free loopback port until stop()."""

    def __init__(self, app, **options):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def api_key() -> str:
    """The key the `server` fixture (and others that ask for it) requires."""
    return API_KEY


@pytest.fixture(scope="session")
def make_engine(make_tiny_lm):
    """make_engine(**Engine kwargs): a fresh Engine over the same tiny random model (same
    seed, same weights, its own tokenizer trained on TEXT, a 96-token context)."""

    def make(**kwargs) -> Engine:
        lm = make_tiny_lm(96, [TEXT * 20], 300, preset="llama-micro")
        return Engine.from_lm(lm, **{"max_batch": 8, **kwargs})

    return make


@pytest.fixture(scope="module")
def live_server():
    """live_server(app, **uvicorn_config options) -> LiveServer; all stopped after the module."""
    started: list[LiveServer] = []

    def start(app, **options) -> LiveServer:
        started.append(LiveServer(app, **options))
        return started[-1]

    yield start
    for live in started:
        live.stop()


@pytest.fixture(scope="module")
def server(make_engine, live_server, api_key):
    """A key-protected server; `.engine` is its Engine."""
    engine = make_engine()
    # One chunk per token (no stream_interval): the page test watches the reply grow, and a
    # tiny model would otherwise finish within one or two 20 ms chunks (test_responses.py).
    app = create_app(engine, "tiny", api_key=api_key, max_tokens_limit=64, stream_interval=0)
    live = live_server(app)
    live.engine = engine
    return live
