"""benchmarks/bench_llamacpp.py records what it prints: the rows of its Markdown table, and the
machine line and matched-pair ratios as the notes."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_llamacpp import COLUMNS, Row, markdown, recorded_table  # noqa: E402


def test_recorded_table_matches_the_printed_one():
    rows = [
        Row("lmforge int8", "int8 weights", 1, 1, 900.4, 144.04, 69.2, 1.0),
        Row("llama.cpp Q8_0", "Q8_0 weights", 1, 1, 412.0, 100.9, 51.0, 0.5),
        Row("llama.cpp Q4_1", "Q4_1 weights", 1, 1, note="not installed"),
    ]
    meta = {
        "cpu": {"model": "Some CPU", "cores": 2, "flags": {"avx2": True}},
        "bandwidth": {1: 28.2},
        "state": "quiet machine",
        "new": 128,
        "reps": 3,
        "torch": "2.x",
        "llama_cpp": "0.3.36",
    }
    table, notes = recorded_table(rows, meta)
    printed = [line for line in markdown(rows, meta).splitlines() if line.startswith("| ")]
    assert len(printed) == 1 + len(table) and all(len(r) == len(COLUMNS) for r in table)
    for line, row in zip(printed[1:], table):
        assert [c.strip() for c in line.strip("|").split("|")] == [str(c) for c in row]
    assert notes.startswith("Some CPU, 2 cores") and "decode 1.43x" in notes
