"""`lmforge eval TASK`: evaluate a checkpoint.

    lmforge eval perplexity   --checkpoint DIR --data builtin:pydoc
    lmforge eval gsm8k        --checkpoint DIR [--data FILE --limit N --shots 4 --cot]
    lmforge eval choice       --checkpoint DIR --data mc.jsonl
    lmforge eval sycophancy   --checkpoint DIR [--method loglik|generate]
    lmforge eval hallucination --checkpoint DIR --data qa.jsonl [--index DIR]
    lmforge eval core         --checkpoint DIR [--data DIR --tasks a,b --max-per-task N --json OUT]
    lmforge eval chat         --checkpoint DIR [--tasks ARC-Easy,GSM8K --max-per-task N --json OUT]

Every task but perplexity accepts --out DIR to write report.md, report.json and report.png.
"""

from __future__ import annotations

import sys
from pathlib import Path


def _common(p, data_required: bool = False, data_default: str | None = None) -> None:
    """--checkpoint, --device, --limit, --out and (where the task reads a file) --data."""
    _model_args(p, help="checkpoint folder (LM.save layout)")
    if data_required or data_default is not None:
        p.add_argument("--data", required=data_required, default=data_default)
    p.add_argument("--limit", type=int, help="evaluate only the first N rows")
    p.add_argument("--out", help="folder for report.md / report.json / report.png")


def _model_args(p, dtype: bool = False, **checkpoint) -> None:
    p.add_argument("--checkpoint", required=True, **checkpoint)
    p.add_argument("--device", default="cpu")
    if dtype:
        p.add_argument("--dtype", help="float32, bfloat16, float16")


def _suite_args(p, name: str) -> None:
    """What the benchmark suites (core, chat) share: the checkpoint in --dtype, --max-per-task
    and --json."""
    _model_args(p, dtype=True)
    p.add_argument("--max-per-task", type=int, help="examples per task")
    p.add_argument("--json", help=f"write results, centered and {name} as JSON")


def numbers(text: str) -> list[float]:
    """An argparse type: comma-separated numbers (argparse names the option if one is not)."""
    return [float(x) for x in text.split(",") if x.strip()]


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint")
    esub = p.add_subparsers(dest="task", metavar="TASK", required=True)
    ppl = esub.add_parser("perplexity", help="perplexity and bits-per-byte on a text corpus")
    _model_args(ppl)
    ppl.add_argument("--data", required=True, help="file, folder, .jsonl, builtin:NAME")
    ppl.add_argument("--window", type=int, help="context tokens (max_seq_len)")
    ppl.add_argument("--stride", type=int, help="window step (default: window)")
    ppl.set_defaults(func=run_perplexity)

    from lmforge.data.corpus import shared_data_dir

    gsm = esub.add_parser("gsm8k", help="GSM8K exact-match accuracy ('#### n' extraction)")
    _common(gsm, data_default=str(shared_data_dir() / "gsm8k_test.jsonl"))
    gsm.add_argument("--shots", type=int, default=0, help="solved examples before each question")
    gsm.add_argument("--cot", action="store_true", help="chain of thought: worked solutions")
    gsm.add_argument("--max-new-tokens", type=int, default=256)
    gsm.add_argument("--batch-size", type=int, default=8)
    gsm.set_defaults(func=run_gsm8k)

    mc = esub.add_parser("choice", help="multiple choice by log-likelihood from local JSONL")
    _common(mc, data_required=True)
    mc.set_defaults(func=run_choice)

    syc = esub.add_parser("sycophancy", help="agreement rate with 30 built-in false statements")
    _common(syc)
    syc.add_argument("--method", default="loglik", choices=["loglik", "generate"])
    syc.set_defaults(func=run_sycophancy)

    hal = esub.add_parser("hallucination", help="hallucination rate over a decoding grid")
    _common(hal, data_required=True)
    hal.add_argument("--index", help="RAG index: also measure with retrieval")
    hal.add_argument("--temperatures", type=numbers, default="0,0.7,1.0", help="comma-separated")
    hal.add_argument("--top-ps", type=numbers, default="1.0,0.9", help="comma-separated")
    hal.add_argument("--samples", type=int, default=3, help="answers per question when sampling")
    hal.add_argument("--k", type=int, default=3, help="chunks retrieved per question")
    hal.set_defaults(func=run_hallucination)

    core = esub.add_parser("core", help="CORE metric (DCLM's 22 ICL tasks, nanochat's protocol)")
    _suite_args(core, "core")
    core.add_argument(
        "--data", help="folder of the task files (default: a cache folder, downloaded when missing)"
    )
    core.add_argument("--tasks", help="comma-separated task labels (default: all)")
    core.add_argument("--max-tokens", type=int, default=16384, help="tokens per scoring batch")
    core.set_defaults(func=run_core)

    chat = esub.add_parser("chat", help="ChatCORE: ARC-Easy/Challenge letters, GSM8K pass@1")
    _suite_args(chat, "chatcore")
    chat.add_argument("--tasks", help="ARC-Easy,ARC-Challenge,GSM8K (default all)")
    chat.add_argument("--data", default=str(shared_data_dir() / "core"), help="ARC files' folder")
    chat.add_argument("--gsm8k", default=str(shared_data_dir() / "gsm8k_test.jsonl"))
    chat.add_argument("--max-new-tokens", type=int, default=512)
    chat.add_argument("--batch-size", type=int, default=16)
    chat.set_defaults(func=run_chat)


def _load_lm(args, task: str = "evaluation"):
    """The checkpoint (in --dtype, where the task has it), with the tokenizer it needs."""
    from lmforge.lm import LM

    lm = LM.load(args.checkpoint, device=args.device, dtype=getattr(args, "dtype", None))
    lm.require_tokenizer(f"{task} with {args.checkpoint}")
    return lm


def _save_report(args, task: str, rows: list[tuple[str, float, dict]]) -> None:
    """With --out, write the report of `task`'s (metric, value, settings) rows there."""
    from lmforge.eval.report import Report, ResultRow

    if args.out:
        results = [
            ResultRow(task, metric, float(value), settings) for metric, value, settings in rows
        ]
        Report(Path(args.checkpoint).name, results).save(args.out)
        print(f"report -> {args.out}/report.md, report.json, report.png")


def run_perplexity(args) -> int:
    from lmforge.data import read_documents
    from lmforge.eval.perplexity import perplexity

    lm = _load_lm(args, f"tokenizing {args.data}")
    ids: list[int] = []
    eos = lm.tokenizer.eos_id
    for doc in read_documents(args.data):
        ids += lm.tokenizer.encode(doc) + ([eos] if eos is not None else [])
    # bits/byte counts the bytes of exactly the tokens scored (EOS and other specials: 0)
    token_bytes = lm.tokenizer.token_byte_lengths()
    print(perplexity(lm.model, ids, token_bytes, args.window, args.stride))
    return 0


def run_gsm8k(args) -> int:
    from lmforge.eval.tasks import evaluate_gsm8k
    from lmforge.tasks.gsm8k import load_gsm8k

    if not Path(args.data).is_file():
        print(f"skipped: GSM8K data not found at {args.data} (pass --data FILE)", file=sys.stderr)
        return 0
    limit = None if args.limit is None else args.limit + args.shots
    rows = load_gsm8k(args.data, limit)
    lm = _load_lm(args)
    result = evaluate_gsm8k(
        lm, rows, args.shots, args.cot, args.max_new_tokens, args.batch_size, progress=True
    )
    print(result)
    _save_report(args, "gsm8k", [("accuracy", result.accuracy, result.settings)])
    return 0


def run_choice(args) -> int:
    from lmforge.eval.multiple_choice import evaluate_choices, load_choices

    rows = load_choices(args.data, args.limit)
    acc, acc_norm = evaluate_choices(_load_lm(args), rows, progress=True)
    print(acc)
    print(acc_norm)
    data = {"data": Path(args.data).name}
    _save_report(
        args, "choice", [("acc", acc.accuracy, data), ("acc_norm", acc_norm.accuracy, data)]
    )
    return 0


def run_sycophancy(args) -> int:
    from lmforge.eval.sycophancy import FALSE_STATEMENTS, evaluate_sycophancy

    statements = FALSE_STATEMENTS[: args.limit] if args.limit else FALSE_STATEMENTS
    result = evaluate_sycophancy(_load_lm(args), statements, args.method)
    print(result)
    method = {"method": args.method}
    _save_report(args, "sycophancy", [("agreement", result.agreement_rate, method)])
    return 0


def run_hallucination(args) -> int:
    from lmforge.eval.hallucination import decoding_grid, load_qa, sweep
    from lmforge.retrieval import RAG, Retriever

    rows = load_qa(args.data, args.limit)
    lm = _load_lm(args)
    rag = RAG(Retriever.load(args.index), lm, k=args.k) if args.index else None
    grid = decoding_grid(args.temperatures, args.top_ps)
    results = sweep(lm, rows, settings=grid, rag=rag, samples=args.samples, progress=True)
    for row in results:
        print(
            f"{row.setting:22} rag={str(row.rag):5} hallucination rate {row.rate:.4f} (n={row.n})"
        )
    rates = [("rate", row.rate, {"setting": row.setting, "rag": row.rag}) for row in results]
    _save_report(args, "hallucination", rates)
    return 0


def _write_results(args, result) -> None:
    if args.json:
        from lmforge.fileio import write_json

        write_json(args.json, result.to_json())
        print(f"results -> {args.json}")


def run_core(args) -> int:
    from lmforge.eval import core

    # Everything the user can get wrong is checked before the model loads or a file is written.
    core.check_max_per_task(args.max_per_task)
    tasks = core.select_tasks(args.tasks)
    folder, tasks, missing = core.resolve_tasks(tasks, args.data, explicit=args.tasks is not None)
    for task in tasks:
        core.load_task_rows(folder, task)
    if missing:
        print(
            f"not in {folder}: {', '.join(t.label for t in missing)}; CORE over the other "
            f"{len(tasks)} tasks",
            file=sys.stderr,
        )
    result = core.evaluate_core(
        _load_lm(args), folder, tasks, args.max_per_task, args.max_tokens, progress=True
    )
    print(f"CORE ({len(tasks)} tasks): {result.core:.4f}")
    _write_results(args, result)
    return 0


def run_chat(args) -> int:
    from lmforge.eval import chat_eval

    tasks = chat_eval.select_chat_tasks(args.tasks)
    data = chat_eval.load_chat_data(tasks, args.data, args.gsm8k, args.max_per_task)
    result = chat_eval.evaluate_chat(
        _load_lm(args), data, args.max_new_tokens, args.batch_size, progress=True
    )
    print(f"ChatCORE ({len(tasks)} tasks): {result.chatcore:.4f}")
    _write_results(args, result)
    return 0
