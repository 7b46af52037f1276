"""The speedrun's report card: `report.md` and `report.html` from the same tables, plus plots.

Sections: the machine it ran on, one table comparing every model on the eval yardstick (the point
of the run: what each stage added), greedy chat samples from every model, one small table per
stage with its own numbers and wall time, the RAG answers with their sources, three plots
(losses, rewards, accuracy by stage) and the commands to chat with and serve the result.
`readme_tables.md` holds the two tables of the README's speedrun section, as the README prints
them, with the CPU they came from.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from lmforge.fileio import read_json, write_text
from lmforge.speedrun.stages import POLICY_STAGES, STAGES
from lmforge.train.metrics import read_series

Table = tuple[list[str], list[list[str]]]  # header, rows


def _fmt(value: Any, digits: int = 4) -> str:
    """A finite float with `digits` decimals (whole, with thousands separators, from 1000 up);
    anything else as str() gives it."""
    if not isinstance(value, float) or not math.isfinite(value):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"


def _read(out: Path, name: str, what: str) -> Any:
    """A JSON file a stage wrote under `out` (None when that stage did not run)."""
    return read_json(out / name, what) if (out / name).is_file() else None


def final_model(out: Path, results: dict[str, Any]) -> Path | None:
    """The last policy the run produced (what to chat with)."""
    return next((out / stage for stage in reversed(POLICY_STAGES) if stage in results), None)


# eval.json's metrics in table order: (key, README header, README decimals)
EVAL_COLUMNS = (("perplexity", "docs perplexity", 1), ("bpb", "bits per byte", 2),
                ("accuracy", "exact match", 3), ("reward", "reward (RM score)", 3),
                ("kl", "KL to SFT", 2), ("core", "CORE", 3), ("arc-easy", "ARC-Easy", 3),
                ("arc-challenge", "ARC-Challenge", 3), ("gsm8k", "GSM8K pass@1", 3),
                ("chatcore", "ChatCORE", 3))  # fmt: skip


def eval_table(out: Path, readme: bool = False) -> Table | None:
    """Every model's yardstick numbers: the report's columns (metric keys, 4 decimals), or with
    `readme` the README's (plain names, fewer decimals)."""
    if (table := _read(out, "eval/eval.json", "eval results")) is None:
        return None
    cols = [c for c in EVAL_COLUMNS if any(c[0] in row for row in table.values())]
    rows = [[stage] + [_fmt(row[c[0]], c[2] if readme else 4) if c[0] in row else "" for c in cols]
            for stage, row in table.items()]  # fmt: skip
    return ["model after", *(c[1] if readme else c[0] for c in cols)], rows


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
    if (answers := _read(out, "rag/answers.json", "RAG answers")) is None:
        return None
    # `sources` are the passages the model was given, `cited` those its answer points to ([n])
    rows = []
    for a in answers:
        first = a["answer"].strip().split("\n")[0][:160]
        given = "yes" if a["expected_source"] in a["sources"] else "no"
        cited = ", ".join(a.get("cited", [])) or "(none)"
        rows.append([a["question"], first, a.get("gold_answer", ""), ", ".join(a["sources"]),
                     cited, a["expected_source"], given])  # fmt: skip
    header = ["question", "answer (first line)", "gold answer", "passages given", "cited",
              "gold topic", "gold among passages"]  # fmt: skip
    return header, rows


def samples_table(out: Path) -> Table | None:
    """Every model's greedy reply to each fixed chat prompt (eval stage's samples.json), grouped
    by prompt so the stages read one after another."""
    if (by_stage := _read(out, "eval/samples.json", "chat samples")) is None:
        return None
    prompts = list(dict.fromkeys(r["prompt"] for replies in by_stage.values() for r in replies))
    rows = [[prompt, stage, " ⏎ ".join(r["reply"].split("\n"))[:200] or "(empty)"]
            for prompt in prompts for stage, replies in by_stage.items()
            for r in replies if r["prompt"] == prompt]  # fmt: skip
    return (["prompt", "model after", "greedy reply"], rows) if rows else None


def machine_line(plan: dict[str, Any]) -> str:
    """Which CPU (or GPU), how many threads and whether the run was deterministic."""
    import torch

    from lmforge.infer.cpu_features import cpu_features

    device = plan.get("device", "auto")
    if device in ("auto", "cuda") and torch.cuda.is_available():
        where = torch.cuda.get_device_name()
    else:
        where = cpu_features().summary()
    threads = 1 if plan.get("deterministic") else (plan.get("threads") or torch.get_num_threads())
    mode = "deterministic (one thread, deterministic algorithms)" if plan.get("deterministic") \
        else f"{threads} thread{'s' if threads != 1 else ''}"  # fmt: skip
    return f"{where}; {mode}"


# ----------------------------------------------------------------------------- README tables


# what each training stage's held-out number measures (exact_match, or accuracy for pairs)
HELD_OUT = {"sft": "exact match", "grpo": "exact match", "ppo": "exact match",
            "reward": "pair accuracy", "dpo": "preference accuracy (implicit reward)"}  # fmt: skip


def _stage_result(stage: str, n: dict[str, Any]) -> str:
    """One README line for a stage's own numbers (keys as the trainers write them)."""
    g = n.get
    if stage == "tokenizer":
        return f"{g('vocab_size', 0):,} tokens, {g('chars_per_token', 0):.2f} chars per token"
    if stage == "pretrain" and "val_loss" in n:
        extra = f", {n['val_bpb']:.2f} bits per byte" if "val_bpb" in n else ""
        return (f"{g('step', '?')} steps, val loss {n['val_loss']:.2f} (perplexity "
                f"{math.exp(n['val_loss']):.1f}{extra})")  # fmt: skip
    key = "accuracy" if stage in ("reward", "dpo") else "exact_match"
    if stage in HELD_OUT and key in n:
        start = g(f"initial_{key}")
        head = f"{start:.3f} → " if isinstance(start, int | float) else ""
        steps = f" in {g('step', '?')} steps" if key == "exact_match" else ""
        return f"held-out {HELD_OUT[stage]} {head}{n[key]:.3f}{steps}"
    if stage == "eval":
        return "the table above"
    if stage == "rag" and "questions" in n:
        k = next((key for key in n if key.startswith("recall@")), None)
        recall = f", {k} {n[k]:.2f}" if k else ""
        return (
            f"{n['questions']} test questions ({g('answers')} answers): exact match "
            f"{g('exact_match', 0):.3f}, F1 {g('f1', 0):.3f}{recall} ({g('mode')})"
        )
    return ", ".join(f"{k} {_fmt(v)}" for k, v in n.items())


def readme_tables(out: Path, plan: dict[str, Any], results: dict[str, Any]) -> str:
    """The README speedrun section's tables for this run, and the machine they came from."""
    total = sum(float(d["seconds"]) for d in results.values())
    lines = [f"A {plan['preset']} run (`lmforge speedrun --preset {plan['preset']}`) on "
             f"{machine_line(plan)}: {total / 60:.1f} minutes of stages.", ""]  # fmt: skip
    if (evals := eval_table(out, readme=True)) is not None:
        lines += [_md_table(evals, right=len(evals[0]) - 1), ""]
    stages = [[stage, _stage_result(stage, done["numbers"]), f"{float(done['seconds']):.0f}"]
              for stage, done in results.items()]  # fmt: skip
    lines.append(_md_table((["stage", "result", "wall s"], stages), right=1))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- plots


def write_plots(out: Path, eval_rows: Table | None) -> list[Path]:
    """loss.png (pretrain + SFT), reward.png (RL stages, DPO margin), accuracy.png (by stage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name: str, title: str) -> None:
        fig.gca().set_title(title)
        fig.tight_layout()
        fig.savefig(plots / name, dpi=100)
        written.append(plots / name)

    panels = {
        "loss.png": [("pretrain", "train", "loss"), ("pretrain", "val", "loss"),
                     ("sft", "train", "loss"), ("sft", "eval", "loss")],
        "reward.png": [("grpo", "train", "reward"), ("grpo", "eval", "reward"),
                       ("ppo", "train", "reward"), ("ppo", "eval", "reward"),
                       ("dpo", "eval", "accuracy"), ("reward", "eval", "accuracy")],
    }  # fmt: skip
    for name, curves in panels.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        for stage, split, metric in curves:
            steps, values = read_series(out / stage / "metrics.csv", split, metric)
            if steps:
                ax.plot(steps, values, label=f"{stage} {split} {metric}")
        if ax.lines:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            save(fig, name, name.removesuffix(".png"))
        plt.close(fig)
    if eval_rows is not None and "accuracy" in eval_rows[0]:
        col = eval_rows[0].index("accuracy")
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar([r[0] for r in eval_rows[1]], [float(r[col]) for r in eval_rows[1]])
        ax.set_ylabel("held-out exact match")
        ax.set_ylim(0, 1)
        save(fig, "accuracy.png", "accuracy by stage")
        plt.close(fig)
    return written


# ----------------------------------------------------------------------------- rendering


def _md_table(table: Table, right: int = 0) -> str:
    """A Markdown table; the last `right` columns are right-aligned (numbers)."""
    header, rows = table
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * (len(header) - right) + "---:|" * right,
    ]
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
    intro = (f"Preset `{plan['preset']}`, corpus `{plan['corpus']}`, task `{plan['task']}`; "
             f"stages took {total / 60:.1f} min in all on {machine_line(plan)}.")  # fmt: skip
    sections = [
        ("Every model on one yardstick", evals),
        ("Chat samples: every model's greedy reply to the same prompts", samples_table(out)),
        *stage_tables(results),
        ("RAG answers over the built-in docs", rag_table(out)),
    ]
    # (title, Markdown body, HTML body) of each section the report shows
    blocks = [(title, _md_table(t), _html_table(t)) for title, t in sections if t is not None]
    if plots:
        md_images = "\n".join(f"![{p.stem}](plots/{p.name})" for p in plots)
        html_images = "".join(f'<img src="plots/{p.name}" alt="{p.stem}">' for p in plots)
        blocks.append(("Plots", md_images, html_images))
    if model := final_model(out, results):
        usage = f"lmforge chat --checkpoint {model}\nlmforge serve --checkpoint {model}"
        blocks.append(("Use the result", f"```\n{usage}\n```", f"<pre>{html.escape(usage)}</pre>"))
    md = [f"# lmforge speedrun: {plan['preset']}", "", intro, ""]
    md += [f"## {title}\n\n{body}\n" for title, body, _ in blocks]
    page = [f"<h1>lmforge speedrun: {html.escape(plan['preset'])}</h1><p>{html.escape(intro)}</p>"]
    page += [f"<h2>{html.escape(title)}</h2>{body}" for title, _, body in blocks]
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}table{border-collapse:"
             "collapse;margin-bottom:1em}td,th{border:1px solid #ccc;padding:.3em .6em;text-align:"
             "left}img{max-width:100%}")  # fmt: skip
    write_text(out / "report.md", "\n".join(md))
    write_text(out / "readme_tables.md", readme_tables(out, plan, results))
    write_text(out / "report.html", f"<!doctype html><html><head><meta charset='utf-8'>"
               f"<title>lmforge speedrun</title><style>{style}</style></head><body>"
               f"{''.join(page)}</body></html>\n")  # fmt: skip
    return out / "report.md"
