"""Load test of `lmforge serve` on loopback: many concurrent streaming clients, bounded in time.

Starts the server in a subprocess (tiny random llama-micro model, its own tokenizer; the server
and the client threads share this machine), then:
  1. phases of 1 client and of 16 clients, alternating, --rounds times each, streaming for
     --phase seconds: aggregate tokens/s, and the ratio of the medians (target: 16 clients >= 4x
     one client, because requests share the decode batch). Same server, model, prompt and
     max_tokens in both. The server's CPU seconds per token are printed too: on a shared
     machine the share of CPU the server gets moves between phases, its CPU per token does not;
  2. 32 clients for --duration seconds: zero errors, every stream ends with a finish_reason,
     a usage chunk and [DONE].

    python benchmarks/load_test.py [--duration 30 --phase 10 --rounds 3]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import requests
from bench_cli import options


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


def run_clients(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[float, int, int]:
    """(tokens/s, completed streams, errors) of `clients` threads looping for `seconds`."""
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phase(url: str, pid: int, clients: int, args) -> tuple[float, float, int]:
    """(tokens/s, server CPU ms per token, errors) of one phase."""
    cpu0, t0 = cpu_seconds(pid), time.time()
    tps, _, errors = run_clients(url, clients, args.phase, args.max_tokens)
    cpu = (cpu_seconds(pid) - cpu0) / (time.time() - t0)
    print(f"  {clients:2d} client(s): {tps:7.1f} tokens/s, server {cpu:.2f} cores, "
          f"{1000 * cpu / max(tps, 1e-9):.3f} CPU ms/token")  # fmt: skip
    return tps, 1000 * cpu / max(tps, 1e-9), errors


def main() -> int:
    numbers = {"--duration": 30.0, "--phase": 10.0, "--rounds": 3, "--max-tokens": 64}
    args = options(__doc__.split("\n")[0], numbers).parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as ckpt:
        make_checkpoint(ckpt)
        # the eager engine its figures were measured on (serve compiles by default)
        cmd = [sys.executable, "-m", "lmforge", "serve", "--checkpoint", ckpt, "--port", str(port),
               "--max-batch", "32", "--no-compile"]  # fmt: skip
        server = subprocess.Popen(cmd)
        try:
            for _ in range(600):
                try:
                    if requests.get(f"{url}/health", timeout=1).ok:
                        break
                except requests.ConnectionError:
                    time.sleep(0.1)
            run_clients(url, 1, 1.0, args.max_tokens)  # warm-up
            results: dict[int, list] = {1: [], 16: []}
            errors = 0
            for _ in range(args.rounds):
                for clients in (1, 16):
                    tps, ms, err = phase(url, server.pid, clients, args)
                    results[clients].append((tps, ms))
                    errors += err
            one, sixteen = ([statistics.median(x[i] for x in results[c]) for i in (0, 1)]
                            for c in (1, 16))  # fmt: skip
            print(
                f"aggregate tokens/s (median of {args.rounds}): 1 client {one[0]:.1f}, "
                f"16 clients {sixteen[0]:.1f} -> {sixteen[0] / one[0]:.1f}x (target >= 4x)"
            )
            print(f"server CPU ms/token: 1 client {one[1]:.3f}, 16 clients {sixteen[1]:.3f} -> "
                  f"{one[1] / sixteen[1]:.1f}x less per token")  # fmt: skip
            tps, streams, err = run_clients(url, 32, args.duration, args.max_tokens)
            errors += err
            print(f"32 clients for {args.duration:.0f}s: {streams} complete streams, "
                  f"{tps:.1f} tokens/s, {errors} errors in all phases (target: 0)")  # fmt: skip
            print("note: shared, loaded 2-core machine (clients and server share it)")
            return 1 if errors else 0
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
