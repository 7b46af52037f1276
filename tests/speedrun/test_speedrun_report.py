"""The report card: the yardstick table, one table per stage, RAG answers, plots, HTML."""

import json

from lmforge.speedrun.presets import resolve_plan
from lmforge.speedrun.report import write_report
from lmforge.train.metrics import MetricsLog


def test_report_tables_plots_and_html(tmp_path):
    (tmp_path / "eval").mkdir()
    table = {"pretrain": {"perplexity": 90.5, "bpb": 2.25, "accuracy": 0.0, "reward": -0.1,
                          "kl": 40.0},
             "sft": {"perplexity": 300.0, "bpb": 2.75, "accuracy": 0.5, "reward": 0.1, "kl": 0.0},
             "grpo": {"perplexity": 310.0, "bpb": 2.8125, "accuracy": 0.75, "reward": 0.2,
                      "kl": 0.3, "core": 0.0125}}  # fmt: skip
    (tmp_path / "eval" / "eval.json").write_text(json.dumps(table))
    samples = {stage: [{"prompt": "2+2=", "reply": f"{stage} says 4"},
                       {"prompt": "Hi", "reply": "line one\nline two"}]
               for stage in ("pretrain", "grpo")}  # fmt: skip
    (tmp_path / "eval" / "samples.json").write_text(json.dumps(samples))
    log = MetricsLog(tmp_path / "grpo")
    for step in range(5):
        log.log(step, "train", reward=0.1 * step)
    (tmp_path / "rag").mkdir()
    answers = [{"question": "What does break do?", "expected_source": "break",
                "answer": "It ends the loop. [1]", "gold_answer": "ends the loop",
                "sources": ["break", "for"], "cited": ["break"]}]  # fmt: skip
    (tmp_path / "rag" / "answers.json").write_text(json.dumps(answers))
    results = {
        "sft": {
            "numbers": {"initial_exact_match": 0.0, "exact_match": 0.5, "step": 450},
            "seconds": 12.0,
        },  # fmt: skip
        "grpo": {"numbers": {"exact_match": 0.75}, "seconds": 30.0},
        "eval": {"numbers": {}, "seconds": 5.0},
        "rag": {"numbers": {"cited_right_source": 1.0}, "seconds": 1.0},
    }
    path = write_report(tmp_path, resolve_plan("cpu-tiny"), results)
    md = path.read_text()
    assert "| model after | perplexity | bpb | accuracy | reward | kl | core |" in md
    assert "| grpo | 310.0000 | 2.8125 | 0.7500 | 0.2000 | 0.3000 | 0.0125 |" in md
    assert "| sft | 300.0000 | 2.7500 | 0.5000 | 0.1000 | 0.0000 |  |" in md  # no CORE for sft
    # chat samples grouped by prompt, every model in turn, newlines shown as ⏎
    assert ("| 2+2= | pretrain | pretrain says 4 |\n| 2+2= | grpo | grpo says 4 |\n"
            "| Hi | pretrain | line one ⏎ line two |") in md  # fmt: skip
    # "1 thread" under the test suite's one-thread setting, "N threads" elsewhere
    assert " thread" in md.split("\n")[2] or "deterministic" in md.split("\n")[2]
    assert "## grpo — GRPO" in md and "| wall time (s) | 30.0000 |" in md
    assert ("| What does break do? | It ends the loop. [1] | ends the loop | break, for | break "
            "| break | yes |") in md  # fmt: skip
    assert f"lmforge chat --checkpoint {tmp_path / 'grpo'}" in md
    html = (tmp_path / "report.html").read_text()
    assert html.count("<table>") == md.count("\n|---") and '<img src="plots/reward.png"' in html
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"reward.png", "accuracy.png"}
    # the README's tables, as the README prints them, naming the machine
    readme = (tmp_path / "readme_tables.md").read_text()
    assert readme.startswith("A cpu-tiny run (`lmforge speedrun --preset cpu-tiny`) on ")
    assert "| model after | docs perplexity | bits per byte | exact match | reward (RM score) " \
           "| KL to SFT | CORE |" in readme  # fmt: skip
    assert "| pretrain | 90.5 | 2.25 | 0.000 | -0.100 | 40.00 |  |" in readme
    assert "| sft | held-out exact match 0.000 → 0.500 in 450 steps | 12 |" in readme
