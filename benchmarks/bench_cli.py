"""The benchmarks' command lines: most options are plain numbers with a default."""

from __future__ import annotations

import argparse


def options(description: str, numbers: dict[str, int | float]) -> argparse.ArgumentParser:
    """A parser holding one option per entry of `numbers` (flag -> default; the option's type is
    the default's); a benchmark adds its other options to it."""
    parser = argparse.ArgumentParser(description=description)
    for flag, default in numbers.items():
        parser.add_argument(flag, type=type(default), default=default)
    return parser
