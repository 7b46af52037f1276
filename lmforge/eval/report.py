"""Evaluation report: one table of results written as Markdown, JSON and a PNG bar chart.

report = Report("tiny-model")
report.add("gsm8k", "accuracy", 0.02, shots=4, cot=True)
report.add("hallucination", "rate", 0.61, setting="T=0.7, top-p=0.9", rag=True)
report.save("runs/eval")   # report.md, report.json, report.png
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from lmforge.fileio import read_json, write_json, write_text


@dataclass
class ResultRow:
    task: str
    metric: str
    value: float
    settings: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return f"{self.task} {self.metric}" + (f" ({extra})" if extra else "")


class Report:
    """An ordered list of (task, metric, value, settings) rows."""

    def __init__(self, model: str = "", rows: list[ResultRow] | None = None):
        self.model, self.rows = model, list(rows or [])

    def add(self, task: str, metric: str, value: float, **settings) -> ResultRow:
        row = ResultRow(task, metric, float(value), settings)
        self.rows.append(row)
        return row

    def to_markdown(self) -> str:
        """A GitHub-flavoured Markdown table, one row per result."""
        lines = [f"# Evaluation: {self.model}" if self.model else "# Evaluation", ""]
        lines += ["| task | metric | value | settings |", "|---|---|---:|---|"]
        for r in self.rows:
            settings = ", ".join(f"{k}={v}" for k, v in r.settings.items())
            lines.append(f"| {r.task} | {r.metric} | {r.value:.4f} | {settings} |")
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict:
        return {"model": self.model, "results": [asdict(r) for r in self.rows]}

    @classmethod
    def load(cls, path: str | Path) -> Report:
        """Read a report.json written by `save`."""
        data = read_json(path, "report")
        return cls(data.get("model", ""), [ResultRow(**r) for r in data.get("results", [])])

    def plot(self, path: str | Path) -> None:
        """A horizontal bar per result, labelled with its task, metric and settings."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [r.label for r in self.rows]
        fig, ax = plt.subplots(figsize=(8, 0.4 * len(labels) + 1.2))
        ax.barh(range(len(labels)), [r.value for r in self.rows], color="tab:blue")
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.invert_yaxis()  # first result on top, as in the table
        ax.set_xlabel("value")
        ax.set_title(f"Evaluation: {self.model}" if self.model else "Evaluation")
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def save(self, directory: str | Path) -> None:
        """Write report.md, report.json and report.png into `directory`."""
        directory = Path(directory)
        write_text(directory / "report.md", self.to_markdown())
        write_json(directory / "report.json", self.to_dict())
        if self.rows:
            self.plot(directory / "report.png")
