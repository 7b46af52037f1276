"""Load test of `lmforge serve` on loopback: many concurrent streaming clients, bounded in time.

Starts the server in a subprocess (tiny random model, its own tokenizer), then:
  1. 1 client, then 16 clients, streaming for --phase seconds each: aggregate tokens/s
     (target: 16 clients >= 4x one client, because requests share the decode batch);
  2. 32 clients for --duration seconds: zero errors, every stream ends with a finish_reason,
     a usage chunk and [DONE].

    python benchmarks/load_test.py [--duration 30 --phase 10]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time

import requests


def make_checkpoint(directory: str) -> None:
    from lmforge.lm import LM
    from lmforge.model.config import ModelConfig
    from lmforge.tokenizer import Tokenizer

    text = "the quick brown fox jumps over the lazy dog; hello there, how are you today? " * 50
    tok = Tokenizer.train_bpe([text], vocab_size=512)
    config = ModelConfig.from_preset("llama-micro", vocab_size=tok.vocab_size, max_seq_len=512)
    LM.from_config(config, tokenizer=tok, seed=0).save(directory)


def stream_once(url: str, max_tokens: int) -> int:
    """One streamed completion; returns its completion tokens or raises on any defect."""
    body = {"prompt": "hello there", "max_tokens": max_tokens, "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    finish, usage, done = None, None, False
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line:
                continue
            data = line.decode()[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                finish = chunk["choices"][0]["finish_reason"]
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    if not (done and finish and usage):
        raise RuntimeError(f"incomplete stream (done={done}, finish={finish}, usage={usage})")
    return usage


def run_clients(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[int, int, int]:
    """(tokens, completed streams, errors) of `clients` threads looping for `seconds`."""
    stats = {"tokens": 0, "streams": 0, "errors": 0}
    lock = threading.Lock()
    deadline = time.time() + seconds

    def worker():
        while time.time() < deadline:
            try:
                n = stream_once(url, max_tokens)
                with lock:
                    stats["tokens"] += n
                    stats["streams"] += 1
            except Exception as err:  # count every failure; the test demands zero
                with lock:
                    stats["errors"] += 1
                print(f"  error: {err}", file=sys.stderr)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - start
    return stats["tokens"] / elapsed, stats["streams"], stats["errors"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--phase", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as ckpt:
        make_checkpoint(ckpt)
        cmd = [sys.executable, "-m", "lmforge", "serve", "--checkpoint", ckpt, "--port", str(port),
               "--max-batch", "32"]  # fmt: skip
        server = subprocess.Popen(cmd)
        try:
            for _ in range(600):
                try:
                    if requests.get(f"{url}/health", timeout=1).ok:
                        break
                except requests.ConnectionError:
                    time.sleep(0.1)
            one, _, e1 = run_clients(url, 1, args.phase, args.max_tokens)
            sixteen, _, e16 = run_clients(url, 16, args.phase, args.max_tokens)
            print(f"aggregate tokens/s: 1 client {one:.1f}, 16 clients {sixteen:.1f} -> "
                  f"{sixteen / one:.1f}x (target >= 4x)")  # fmt: skip
            tps, streams, errors = run_clients(url, 32, args.duration, args.max_tokens)
            errors += e1 + e16
            print(f"32 clients for {args.duration:.0f}s: {streams} complete streams, "
                  f"{tps:.1f} tokens/s, {errors} errors (target: 0)")  # fmt: skip
            print("note: shared, loaded 2-core machine (clients and server share it)")
            return 1 if errors else 0
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
