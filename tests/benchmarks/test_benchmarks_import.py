"""Every benchmark script imports: the scripts run for an hour, not in CI, so a refactor that
moves a name they import would otherwise break them silently (it did: bench_vlm_shapes.py
imported patch_mixing from where it no longer lived)."""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

IMPORT_ALL = """
import importlib, sys
sys.path.insert(0, sys.argv[1])
failed = []
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - report every broken script, not the first
        failed.append(f"{name}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_benchmark_script_imports():
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    assert "recipes" in names and "bench_vlm_shapes" in names
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, str(BENCHMARKS), *names],
        capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
