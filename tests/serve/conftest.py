"""A live server on 127.0.0.1 (uvicorn in a thread) around a tiny random model, per module."""

import socket
import threading
import time

import pytest
import torch

from lmforge.infer.engine import Engine
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.serve.app import create_app
from lmforge.tokenizer import Tokenizer

API_KEY = "test-key"
TEXT = "hello there, how are you today? I am fine. The quick brown fox jumps over the lazy dog. "


def tiny_lm() -> LM:
    torch.manual_seed(0)
    tok = Tokenizer.train_bpe([TEXT * 20], vocab_size=300)
    config = ModelConfig.from_preset("llama-micro", vocab_size=tok.vocab_size, max_seq_len=96)
    return LM.from_config(config, tokenizer=tok, seed=0)


class LiveServer:
    """uvicorn serving `app` on a free loopback port until stop()."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
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


@pytest.fixture(scope="module")
def server():
    engine = Engine.from_lm(tiny_lm(), max_batch=8)
    # One chunk per token (no stream_interval): the page test watches the reply grow, and a
    # tiny model would otherwise finish within one or two 20 ms chunks (test_responses.py).
    app = create_app(engine, "tiny", api_key=API_KEY, max_tokens_limit=64, stream_interval=0)
    live = LiveServer(app)
    live.engine = engine
    yield live
    live.stop()
