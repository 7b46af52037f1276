"""The `lmforge` command: one subcommand per stage, each defined in its own module.

A module in COMMANDS provides `register(subparsers)`, which adds its parser and sets
`func=run(args)`. Bad input (LMForgeError) is printed as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from lmforge.errors import LMForgeError

COMMANDS = [
    "lmforge.cli.pretrain",
    "lmforge.cli.tokenizer",
    "lmforge.cli.generate",
    "lmforge.cli.evaluate",
    "lmforge.cli.rag",
    "lmforge.cli.model_info",
    "lmforge.cli.precision",
    "lmforge.cli.seq2seq",
    "lmforge.cli.classify",
    "lmforge.cli.convert",
    "lmforge.cli.align",
    "lmforge.cli.rl",
    "lmforge.cli.chat",
    "lmforge.cli.serve",
    "lmforge.cli.vlm",
    "lmforge.cli.checkpoint",
    "lmforge.cli.speedrun",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Train, fine-tune, align, serve and evaluate causal transformer LMs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        return int(args.func(args) or 0)
    except LMForgeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
