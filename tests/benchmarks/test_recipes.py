"""benchmarks/recipes.py end to end on a tiny model (`--smoke`): the protocol checks, the
starting model, the recipe and its compute-matched SFT baseline each run through the CLI verb
in their own process, and the report carries before / after / baseline, paired bootstrap
intervals, wall times and peak memory."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAIRS = ["implicit_reward_accuracy", "likelihood_accuracy"]
TASK = ["exact_match", "numeric_match"]
METRICS = {"lora-sft-gsm8k": ["pass@1"], "grpo-gsm8k": ["pass@1"], "dpo-hh": PAIRS,
           "lora-sft-arith": TASK, "dpo-arith": TASK + PAIRS + [f"onpolicy_{m}" for m in PAIRS],
           "grpo-arith": TASK}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("recipe", sorted(METRICS))
def test_recipe_smoke(recipe, tmp_path, shared_data):
    run = subprocess.run(
        [sys.executable, "benchmarks/recipes.py", "--recipe", recipe, "--smoke", "--out",
         str(tmp_path), "--resamples", "500"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    name = f"{recipe}-cpu"
    report = json.loads((tmp_path / f"{name}.json").read_text())
    assert (tmp_path / f"{name}.md").read_text().startswith(f"# {recipe} (cpu, smoke)")
    assert sorted(report["metrics"]) == sorted(METRICS[recipe])
    pairs = report["policy_pairs"]
    for name_, m in report["metrics"].items():
        for key in ("before", "after", "baseline"):
            assert 0.0 <= m[key] <= 1.0
        # the on-policy pairs: one per test prompt whose samples disagree
        n = pairs["pairs"] if name_.startswith("onpolicy_") else report["test"]["scored"]
        for key in ("after_minus_baseline", "after_minus_before"):
            diff = m[key]
            assert diff["low"] <= diff["diff"] + 1e-9 and diff["diff"] <= diff["high"] + 1e-9
            assert diff["confidence"] == 0.95 and diff["n"] == n >= 2
    if recipe == "dpo-arith":  # the start model's own answers to the first n test prompts
        assert (
            pairs["pairs"] + pairs["unpaired"] == pairs["n"] == 12
            and pairs["pairs_per_prompt"] == 1
        )
        sampled = json.loads((tmp_path / f"{name}-test-pairs.result.json").read_text())
        assert len(sampled["pairs"]) == len(sampled["text"]) == pairs["pairs"]
        for chosen_ids, chosen_labels, rejected_ids, rejected_labels in sampled["pairs"]:
            assert chosen_ids != rejected_ids and len(chosen_ids) == len(chosen_labels)
            assert len(rejected_ids) == len(rejected_labels)
            cut = chosen_labels.index(next(t for t in chosen_labels if t != -100))
            assert chosen_ids[:cut] == rejected_ids[:cut]  # the same prompt, two answers
    else:
        assert pairs is None
    judged = {"reward-model", "after-answers", "baseline-answers", "win-rate"}
    stages = {"before-test", "recipe", "baseline", "after-test", "baseline-test"}
    if recipe == "lora-sft-arith":  # the baseline is the start model prompted with 8 shots
        stages.remove("baseline")
    if recipe == "dpo-arith":  # two more scorers: the canned test pairs, the on-policy ones
        stages |= {f"{m}-test-{kind}" for m in ("before", "after", "baseline")
                   for kind in ("preference", "policy-preference")} | {"test-pairs"}  # fmt: skip
    assert set(report["stages"]) == stages | (judged if recipe == "dpo-hh" else set())
    for s in report["stages"].values():
        assert s["wall_s"] > 0 and s["peak_rss_mb"] > 50
    assert report["machine"]["cpu"] and report["machine"]["threads"] == 1

    # the protocol: the runs choose on validation; test is read only by the scoring stages
    cfg, base = report["config"], report["baseline_config"]
    test_source = report["test"]["source"]
    assert re.search(r":validation(:chat)?$", cfg["eval_data"])
    assert report["validation"]["recipe"], "the recipe's periodic evaluation left no curve"
    if recipe == "lora-sft-arith":
        assert base == {"shots": 8, "shots_from": cfg["data"]} and "test" not in cfg["data"]
        return
    for c in (cfg, base):
        assert test_source not in (c["data"], c["eval_data"])
    # compute-matched: the same steps, from the same start
    assert base["max_iters"] == cfg["max_iters"] and base["init"] == cfg["init"]
    if recipe == "grpo-gsm8k":
        assert base["batch_size"] == cfg["batch_size"] * cfg["group_size"]
    elif recipe == "grpo-arith":  # RSFT: the same rollouts, one SFT step on the kept samples
        assert base["batch_size"] == cfg["batch_size"] and base["group_size"] == cfg["group_size"]
        assert base["minibatch_size"] == cfg["batch_size"] * cfg["group_size"]
    else:
        assert base["batch_size"] == cfg["batch_size"]
    if recipe == "lora-sft-gsm8k":
        assert base["peft"] == "none" and cfg["peft"] == "lora"
    if recipe.startswith("dpo"):
        first = json.loads(Path(base["data"]).read_text().splitlines()[0])
        assert set(first) == {"prompt", "response"}
    saved = yaml.safe_load((tmp_path / f"{name}-baseline.yaml").read_text())
    assert saved == base

    # dpo-hh: the win rate of the DPO model's answers over the SFT baseline's under a reward
    # model trained on train, chosen on validation, from the same start
    win, rm = report["win_rate"], report["reward_model_config"]
    if recipe != "dpo-hh":
        assert win is None and rm is None
        return
    assert 0.0 <= win["low"] <= win["win_rate"] <= win["high"] <= 1.0
    assert win["n"] == 6 == win["wins"] + win["ties"] + win["losses"]
    assert win["win_rate"] == pytest.approx((win["wins"] + 0.5 * win["ties"]) / win["n"])
    assert win["minus_half"]["diff"] == pytest.approx(win["win_rate"] - 0.5)
    assert win["minus_half"]["n"] == win["n"] and win["minus_half"]["confidence"] == 0.95
    assert 0.0 <= win["reward_model_final"]["accuracy"] <= 1.0
    assert rm["init"] == cfg["init"] and rm["data"] == cfg["data"]
    assert rm["eval_data"] == cfg["eval_data"] and test_source not in (rm["data"], rm["eval_data"])
    assert report["validation"]["reward_model"]["accuracy"]
    assert yaml.safe_load((tmp_path / "dpo-hh-rm-cpu.yaml").read_text()) == rm
    rows = [json.loads(line) for line in (tmp_path / f"{name}-answers.jsonl").open()]
    assert len(rows) == win["n"]
    assert [r["win"] for r in rows] == [
        1.0 if r["after_reward"] > r["baseline_reward"] else
        0.5 if r["after_reward"] == r["baseline_reward"] else 0.0 for r in rows
    ]  # fmt: skip
    assert all(r["prompt"].endswith("\n\nAssistant:") for r in rows)
