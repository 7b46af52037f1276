"""No top-level name is defined in two modules of lmforge/ for different things (issue 34, "Names"):
a reader who meets `Replay` or `completion_logprobs` must not have to ask which one.

Top-level names are functions, classes and assigned names at module level (dunders aside).
`ALLOWED` lists the names that may repeat and why.
"""

import ast
from collections import defaultdict
from pathlib import Path

LMFORGE = Path(__file__).resolve().parents[1] / "lmforge"

ALLOWED = {
    # every CLI module has the same two entry points: main.py calls register(), a verb runs run()
    "register": "the CLI verb protocol",
    "run": "the CLI verb protocol",
    # the same rule in the parser (no torch import to build it) and in vlm/data.py; a test
    # (tests/vlm) checks that the two are equal
    "IMAGE_RULE": "one value, kept in two layers on purpose",
    # -100, the label cross-entropy ignores, in align/ and vlm/ (same layer: neither may import
    # the other); the same value, not two meanings
    "IGNORE": "one value, two packages of the same layer",
}


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("__")}


def test_no_top_level_name_is_defined_twice():
    where = defaultdict(list)
    for path in sorted(LMFORGE.rglob("*.py")):
        for name in top_level_names(path):
            where[name].append(str(path.relative_to(LMFORGE)))
    repeated = {n: paths for n, paths in where.items() if len(paths) > 1 and n not in ALLOWED}
    assert not repeated, f"top-level names defined in more than one module: {repeated}"


def test_the_check_sees_a_repeated_name(tmp_path):
    (tmp_path / "a.py").write_text("def load():\n    pass\nX = 1\n")
    (tmp_path / "b.py").write_text("class load:\n    pass\n")
    assert top_level_names(tmp_path / "a.py") & top_level_names(tmp_path / "b.py") == {"load"}
