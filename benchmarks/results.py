"""One place where benchmark figures are kept: each script records its tables as JSON, and
docs/benchmarks.md is rendered from all of them.

A benchmark calls `record(name, title, columns, rows, notes=...)` at its end. That writes
`benchmarks/results/<name>.json` with the command that ran (`sys.argv`), the commit, the date,
the CPU (`lscpu`'s model name and its SIMD flags) and the table, then re-renders
docs/benchmarks.md from every JSON file in the folder. A figure in the README is copied from
docs/benchmarks.md, so every figure has a command and a machine beside it; a figure whose JSON
is deleted disappears from the page on the next render.

`python benchmarks/results.py` re-renders the page without running anything.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"

_SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def machine() -> dict:
    """The CPU the figures were measured on: model name, SIMD flags of note, cores, torch."""
    name, flags = platform.processor() or "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
        m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        if m:
            name = m.group(1).strip()
        m = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        if m:
            flags = set(m.group(1).split())
        fam = re.search(r"^cpu family\s*:\s*(\d+)$", text, re.M)
        mod = re.search(r"^model\s*:\s*(\d+)$", text, re.M)
        if fam and mod:
            name += f" (family {fam.group(1)} model {mod.group(1)})"
    except OSError:
        pass
    try:
        import os

        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = None
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - every benchmark has torch
        torch_version = None
    return {
        "cpu": name,
        "simd": [f for f in _SIMD_FLAGS if f in flags],
        "cores": cores,
        "torch": torch_version,
    }


def timing_setup() -> str:
    """Set torch to OMP_NUM_THREADS threads (1 when unset) for a timed run and return `uptime`'s
    line, to note beside the figures (the host may be shared)."""
    import os

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def add_speed_args(p, name: str, new: int = 64, repeats: int = 3) -> None:
    """The options every speed benchmark shares: --threads, --prompt, --new (tokens generated),
    --repeats, --name (the result's name under benchmarks/results/) and --no-record."""
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new", type=int, default=new, help="greedy tokens generated")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--name", default=name, help="result name (benchmarks/results/)")
    p.add_argument("--no-record", action="store_true")


def record(
    name: str,
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[object]],
    notes: str = "",
    command: str | None = None,
) -> Path:
    """Write one benchmark table as JSON and re-render docs/benchmarks.md.

    `name` is the file stem (one table per name; a re-run replaces it), `notes` a paragraph
    saying what the columns mean and what both sides ran with (precision, batch, threads).
    """
    if not re.fullmatch(r"[a-z0-9_\-]+", name):
        raise ValueError(f"result name {name!r}: use lower-case letters, digits, - and _")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    entry = {
        "name": name,
        "title": title,
        "command": command or "python " + " ".join(sys.argv),
        "commit": _commit(),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "columns": list(columns),
        "rows": [[_plain(v) for v in row] for row in rows],
        "notes": notes,
    }
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    tmp.replace(path)
    render()
    return path


def _plain(v: object) -> object:
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, (int, str)) or v is None:
        return v
    return str(v)


def _cell(v: object) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.1f}"
    return str(v).replace("|", "\\|")


def render() -> str:
    """Rebuild docs/benchmarks.md from every recorded table; returns the page's text."""
    entries = []
    for p in sorted(RESULTS_DIR.glob("*.json")):
        try:
            entries.append(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"skipping {p.name}: {e}", file=sys.stderr)
    lines = [
        "# Benchmarks",
        "",
        "Generated by `benchmarks/results.py` from `benchmarks/results/*.json`; every table was",
        "written by the command shown under it. Do not edit by hand: re-run the command.",
        "",
    ]
    for e in sorted(entries, key=lambda e: e["title"]):
        m = e["machine"]
        simd = ", ".join(m.get("simd") or []) or "no AVX2"
        lines += [
            f"## {e['title']}",
            "",
            f"`{e['command']}` — commit {e['commit']}, {e['date']}, {m['cpu']} "
            f"({m.get('cores')} cores; {simd}), torch {m.get('torch')}",
            "",
            "| " + " | ".join(e["columns"]) + " |",
            "|" + "|".join("---" for _ in e["columns"]) + "|",
        ]
        lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in e["rows"]]
        if e.get("notes"):
            lines += ["", e["notes"]]
        lines.append("")
    text = "\n".join(lines)
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    return text


if __name__ == "__main__":
    render()
    print(f"wrote {PAGE}")
