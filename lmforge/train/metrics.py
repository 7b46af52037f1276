"""Run logging: a metrics CSV (appended, so resumed runs continue it), optional TensorBoard,
and a PNG plot of the curves at the end of a run."""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path


def read_series(path: str | Path, split: str, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one curve in a metrics.csv; empty lists if the file is absent."""
    if not Path(path).is_file():
        return [], []
    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"] == split and r["metric"] == metric]
    return [int(r["step"]) for r in rows], [float(r["value"]) for r in rows]


class MetricsLog:
    """Rows of {step, split, name: value...} to metrics.csv; plot(...) draws them. Without an
    out_dir it records nothing (the ranks other than 0: rank 0 writes the CSV and the plot)."""

    def __init__(self, out_dir: str | Path | None, tensorboard: bool = False, resume: bool = False):
        self.path = None if out_dir is None else Path(out_dir) / "metrics.csv"
        self.writer = None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume:
            self.path.unlink(missing_ok=True)
        if tensorboard:
            with contextlib.suppress(ImportError):  # tensorboard not installed: the CSV only
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.path.parent / "tensorboard"))

    def log(self, step: int, split: str, **values: float) -> None:
        """Append one row per value to metrics.csv (and TensorBoard when on)."""
        if self.path is None:
            return
        new_file = not self.path.exists()
        with open(self.path, "a", newline="") as fh:
            writer = csv.writer(fh)
            if new_file:
                writer.writerow(["step", "split", "metric", "value"])
            writer.writerows([step, split, name, f"{value:.6g}"] for name, value in values.items())
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(f"{split}/{name}", value, step)

    def plot(self, curves: list[tuple[str, str]], path: str | Path, title: str = "") -> Path:
        """One panel per metric name; each (split, metric) a line. Writes a PNG (not without
        an out_dir)."""
        if self.path is None:
            return Path(path)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        metrics = list(dict.fromkeys(m for _, m in curves))  # in order of first mention
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.5), squeeze=False)
        for ax, metric in zip(axes[0], metrics):
            for split in [s for s, m in curves if m == metric]:
                steps, values = read_series(self.path, split, metric)  # none: no CSV yet
                if steps:
                    ax.plot(steps, values, label=split, marker="." if len(steps) < 30 else None)
            ax.set_xlabel("step")
            ax.set_ylabel(metric)
            ax.grid(alpha=0.3)
            if ax.lines:  # a curve with no points yet has no legend entry
                ax.legend()
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
