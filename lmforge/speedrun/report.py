"""The speedrun's report card: `report.md` and `report.html` from the same tables, plus plots.

Sections: one table comparing every model on the eval yardstick (the point of the run: what each
stage added), then one small table per stage with its own numbers and wall time, the RAG answers
with their sources, three plots (losses, rewards, accuracy by stage) and the commands to chat with
and serve the result.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from lmforge.fileio import read_json, write_text
from lmforge.speedrun.stages import POLICIES, STAGES
from lmforge.train.metrics import read_series

Table = tuple[list[str], list[list[str]]]  # header, rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def final_model(out: Path, results: dict[str, Any]) -> Path | None:
    """The last policy the run produced (what to chat with)."""
    for stage in reversed(POLICIES):
        if stage in results:
            return out / stage
    return None


def eval_table(out: Path) -> Table | None:
    path = out / "eval" / "eval.json"
    if not path.is_file():
        return None
    table = read_json(path, "eval results")
    metrics = [m for m in ("perplexity", "bpb", "accuracy", "reward", "kl") if any(
        m in row for row in table.values())]  # fmt: skip
    rows = [[stage] + [_fmt(row.get(m, "")) for m in metrics] for stage, row in table.items()]
    return ["model after", *metrics], rows


def stage_tables(results: dict[str, Any]) -> list[tuple[str, Table]]:
    out = []
    for stage, done in results.items():
        if stage == "eval":
            continue
        rows = [[k, _fmt(v)] for k, v in done["numbers"].items()]
        rows.append(["wall time (s)", _fmt(float(done["seconds"]))])
        out.append((f"{stage} — {STAGES[stage].title}", (["metric", "value"], rows)))
    return out


def rag_table(out: Path) -> Table | None:
    path = out / "rag" / "answers.json"
    if not path.is_file():
        return None
    rows = []
    for a in read_json(path, "RAG answers"):
        first = a["answer"].strip().split("\n")[0][:160]
        right = "yes" if a["expected_source"] in a["sources"] else "no"
        rows.append([a["question"], first, ", ".join(a["sources"]), a["expected_source"], right])
    return ["question", "answer (first line)", "cited sources", "expected", "right source"], rows


# ----------------------------------------------------------------------------- plots


def write_plots(out: Path, eval_rows: Table | None) -> list[Path]:
    """loss.png (pretrain + SFT), reward.png (RL stages, DPO margin), accuracy.png (by stage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    panels = {
        "loss.png": [("pretrain", "train", "loss"), ("pretrain", "val", "loss"),
                     ("sft", "train", "loss"), ("sft", "eval", "loss")],
        "reward.png": [("grpo", "train", "reward"), ("grpo", "eval", "reward"),
                       ("ppo", "train", "reward"), ("ppo", "eval", "reward"),
                       ("dpo", "eval", "accuracy"), ("reward", "eval", "accuracy")],
    }  # fmt: skip
    for name, curves in panels.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        drawn = 0
        for stage, split, metric in curves:
            steps, values = read_series(out / stage / "metrics.csv", split, metric)
            if steps:
                ax.plot(steps, values, label=f"{stage} {split} {metric}")
                drawn += 1
        if drawn:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            ax.set_title(name.removesuffix(".png"))
            fig.tight_layout()
            fig.savefig(plots / name, dpi=100)
            written.append(plots / name)
        plt.close(fig)
    if eval_rows is not None and "accuracy" in eval_rows[0]:
        col = eval_rows[0].index("accuracy")
        fig, ax = plt.subplots(figsize=(7, 4))
        stages = [r[0] for r in eval_rows[1]]
        ax.bar(stages, [float(r[col]) for r in eval_rows[1]], color="tab:blue")
        ax.set_ylabel("held-out exact match")
        ax.set_ylim(0, 1)
        ax.set_title("accuracy by stage")
        fig.tight_layout()
        fig.savefig(plots / "accuracy.png", dpi=100)
        plt.close(fig)
        written.append(plots / "accuracy.png")
    return written


# ----------------------------------------------------------------------------- rendering


def _md_table(table: Table) -> str:
    header, rows = table
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _html_table(table: Table) -> str:
    header, rows = table
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def write_report(out: Path, plan: dict[str, Any], results: dict[str, Any]) -> Path:
    """Write OUT/report.md and OUT/report.html; returns the Markdown path."""
    total = sum(float(d["seconds"]) for d in results.values())
    evals = eval_table(out)
    plots = write_plots(out, evals)
    sections: list[tuple[str, Table | str]] = []
    intro = (f"Preset `{plan['preset']}`, corpus `{plan['corpus']}`, task `{plan['task']}`; "
             f"stages took {total / 60:.1f} min in all.")  # fmt: skip
    if evals is not None:
        sections.append(("Every model on one yardstick", evals))
    sections += stage_tables(results)
    rag = rag_table(out)
    if rag is not None:
        sections.append(("RAG answers over the built-in docs", rag))
    model = final_model(out, results)
    usage = (
        f"lmforge chat --checkpoint {model}\nlmforge serve --checkpoint {model}" if model else ""
    )
    md = [f"# lmforge speedrun: {plan['preset']}", "", intro, ""]
    page = [f"<h1>lmforge speedrun: {html.escape(plan['preset'])}</h1><p>{html.escape(intro)}</p>"]
    for title, table in sections:
        md += [f"## {title}", "", _md_table(table), ""]
        page.append(f"<h2>{html.escape(title)}</h2>{_html_table(table)}")
    if plots:
        md += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
        page.append("<h2>Plots</h2>" + "".join(
            f'<img src="plots/{p.name}" alt="{p.stem}">' for p in plots))  # fmt: skip
    if usage:
        md += ["## Use the result", "", "```", usage, "```", ""]
        page.append(f"<h2>Use the result</h2><pre>{html.escape(usage)}</pre>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:"
             "collapse;margin-bottom:1em}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:"
             "left}img{max-width:100%}")  # fmt: skip
    write_text(out / "report.md", "\n".join(md))
    write_text(out / "report.html", f"<!doctype html><html><head><meta charset='utf-8'>"
               f"<title>lmforge speedrun</title><style>{style}</style></head><body>"
               f"{''.join(page)}</body></html>\n")  # fmt: skip
    return out / "report.md"
