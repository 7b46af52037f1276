"""`lmforge serve`: an OpenAI-compatible HTTP server (and a chat page at /) for a checkpoint."""

from __future__ import annotations

import sys

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(sub) -> None:
    from lmforge.cli.generate import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible API server with a web chat page")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (with tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument(
        "--max-tokens-limit", type=int, default=None,
        help="largest max_tokens a request may ask for (default: the context)",
    )  # fmt: skip
    p.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    p.add_argument("--model-name", default=None, help="name in /v1/models (default: dir name)")
    add_engine_args(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (on CPU: AOTInductor, ~1.6x faster after ~20 s of "
        "compiling per batch-size range; on GPUs the step replays as a CUDA graph either way)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import uvicorn

    from lmforge.infer.engine import Engine
    from lmforge.lm import LM
    from lmforge.serve.app import create_app

    lm = LM.load(args.checkpoint, device=args.device)
    engine = Engine.from_lm(
        lm,
        max_batch=args.max_batch,
        compile=args.compile,
        dtype=args.dtype,
        quantize=args.quantize,
    )
    name = args.model_name or lm_name(args.checkpoint)
    app = create_app(engine, name, args.api_key, args.max_tokens_limit)
    if args.host not in LOOPBACK and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key", file=sys.stderr)
    print(f"serving {name!r} on http://{args.host}:{args.port}/ (chat page at /)")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def lm_name(path: str) -> str:
    from pathlib import Path

    return Path(path).resolve().name
