"""Results report: Markdown table, JSON round trip, PNG plot."""

import json

from lmforge.eval.report import Report


def test_markdown_json_and_png(tmp_path):
    report = Report("tiny")
    report.add("gsm8k", "accuracy", 0.25, shots=4, cot=True)
    report.add("hallucination", "rate", 0.5, setting="T=0.7, top-p=0.9", rag=False)
    md = report.to_markdown()
    assert md.splitlines()[:4] == [
        "# Evaluation: tiny",
        "",
        "| task | metric | value | settings |",
        "|---|---|---:|---|",
    ]
    assert "| gsm8k | accuracy | 0.2500 | shots=4, cot=True |" in md
    report.save(tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["results"][1] == {
        "task": "hallucination",
        "metric": "rate",
        "value": 0.5,
        "settings": {"setting": "T=0.7, top-p=0.9", "rag": False},
    }
    assert Report.load(tmp_path / "report.json").to_markdown() == md
    assert (tmp_path / "report.md").read_text() == md
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
