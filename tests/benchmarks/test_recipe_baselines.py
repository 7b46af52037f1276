"""The compute-matched baselines of benchmarks/recipes.py train on what the recipe trains on."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import recipes  # noqa: E402

from lmforge.align import data as D  # noqa: E402


def test_chosen_sft_baseline_of_task_pairs_uses_the_recipes_problems(tmp_path):
    # a DPO run on a task's own pairs (pairs_from: data) draws its train problems with its seed
    # and its validation problems with seed + 1 (AlignTrainer.load_examples); the baseline's
    # chosen replies must be those very problems' answers, not another draw
    cfg = {"data": "task:arith:2:train:chat", "eval_data": "task:arith:2:validation:chat",
           "n_train": 24, "n_eval": 8, "seed": 1337, "pairs_from": "data",
           "out_dir": "x"}  # fmt: skip
    base = recipes.chosen_sft_baseline(cfg, "cpu", tmp_path)
    for key, n, seed in (("data", 24, 1337), ("eval_data", 8, 1338)):
        rows = [json.loads(line) for line in Path(base[key]).read_text().splitlines()]
        pairs = [r for _, r in D.records_from(cfg[key], "preference", n=n, seed=seed)]
        assert [(r["prompt"], r["response"]) for r in rows] == [
            (p["prompt"], p["chosen"]) for p in pairs
        ]
        other = [r for _, r in D.records_from(cfg[key], "preference", n=n, seed=0)]
        assert [r["prompt"] for r in rows] != [p["prompt"] for p in other]
    assert base["eval_generate"] == 0 and base["n_train"] == 24
