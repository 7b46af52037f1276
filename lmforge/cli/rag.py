"""`lmforge rag index|ask|eval`: build a retrieval index, answer from it with sources, score it.

    lmforge rag index --out runs/pydoc-index                  # the Python reference docs
    lmforge rag ask --index runs/pydoc-index --question "How do I leave a loop early?" \
        --model SmolLM2-135M-Instruct.Q4_1.gguf               # or an lmforge / HF folder
    lmforge rag eval --index runs/pydoc-index --split test --model ...   # EM/F1, recall@k

With --model a chat model generates a short answer citing its passages [n]. Without it nothing is
generated: the output is extractive (the retrieved sentences closest to the question) and is
labelled so.
"""

from __future__ import annotations

import sys
import time


def register(sub) -> None:
    p = sub.add_parser("rag", help="retrieval-augmented generation: index a corpus, ask it")
    rsub = p.add_subparsers(dest="rag_command", metavar="ACTION", required=True)

    idx = rsub.add_parser("index", help="chunk a corpus and index it (BM25 + dense embeddings)")
    idx.add_argument(
        "--corpus", default="builtin:pydoc", help="builtin:pydoc, a file, a folder or a .jsonl"
    )
    idx.add_argument("--out", required=True, help="index folder to write")
    idx.add_argument("--chunk-size", type=int, default=120, help="window size (units)")
    idx.add_argument("--overlap", type=int, default=30, help="units shared by adjacent windows")
    idx.add_argument("--unit", default="word", choices=["word", "char"])
    idx.add_argument(
        "--encoder",
        default="all-MiniLM-L6-v2",
        help="sentence encoder name or folder; 'none' for a BM25-only index",
    )
    idx.add_argument("--batch-size", type=int, default=32)
    idx.set_defaults(func=run_index)

    ask = rsub.add_parser("ask", help="answer a question from an index, citing its sources")
    ask.add_argument("--index", required=True, help="folder written by `lmforge rag index`")
    ask.add_argument("--question", required=True)
    _add_answer_args(ask)
    ask.set_defaults(func=run_ask)

    ev = rsub.add_parser(
        "eval", help="score retrieval (recall@k, MRR) and answers (exact match, F1) on questions"
    )
    ev.add_argument("--index", required=True, help="folder written by `lmforge rag index`")
    ev.add_argument("--questions", help="question set .jsonl (default: the shipped pydoc set)")
    ev.add_argument("--split", default="test", choices=["validation", "test", "all"])
    ev.add_argument("--out", help="write per-question results to this .json file")
    _add_answer_args(ev)
    ev.set_defaults(func=run_eval)


def _add_answer_args(p) -> None:
    p.add_argument(
        "--model",
        "--checkpoint",
        dest="model",
        help="chat model that writes the answer: an lmforge/HF folder or a .gguf file "
        "(default: none, extractive output)",
    )
    p.add_argument("--k", type=int, default=5, help="chunks to retrieve")
    p.add_argument("--mode", default="hybrid", choices=["bm25", "dense", "hybrid"])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", default="cpu")


def run_index(args) -> int:
    from lmforge.retrieval import Retriever, chunk_corpus

    t0 = time.perf_counter()
    chunks, corpus = chunk_corpus(args.corpus, args.chunk_size, args.overlap, args.unit)
    if corpus.skipped:
        print(f"warning: {corpus.skip_message()}", file=sys.stderr)
    encoder = None if args.encoder.lower() == "none" else args.encoder
    settings = dict(
        corpus=str(args.corpus), chunk_size=args.chunk_size, overlap=args.overlap, unit=args.unit
    )
    retriever = Retriever.build(chunks, encoder, None, args.batch_size, settings, progress=True)
    retriever.save(args.out)
    print(
        f"indexed {len(chunks)} chunks from {len(corpus.documents)} documents "
        f"({', '.join(retriever.modes)}) in {time.perf_counter() - t0:.1f}s -> {args.out}"
    )
    return 0


def _rag(args, retriever):
    """The RAG of `rag ask` / `rag eval`: over `retriever`, answers written by --model if given."""
    from lmforge.lm import LM
    from lmforge.retrieval import RAG

    lm = LM.load(args.model, device=args.device) if args.model else None
    return RAG(retriever, lm, k=args.k, mode=args.mode, max_new_tokens=args.max_new_tokens,
               temperature=args.temperature)  # fmt: skip


def run_ask(args) -> int:
    from lmforge.retrieval import Retriever

    rag = _rag(args, Retriever.load(args.index))
    print(rag.ask(args.question).format())
    return 0


def run_eval(args) -> int:
    from lmforge.fileio import write_json
    from lmforge.retrieval import Retriever
    from lmforge.retrieval.evaluate import (
        PYDOC_QUESTIONS,
        answer_scores,
        check_gold_topics,
        load_questions,
        retrieval_scores,
    )

    path = args.questions or PYDOC_QUESTIONS
    questions = load_questions(path, None if args.split == "all" else args.split)
    retriever = Retriever.load(args.index)
    check_gold_topics(questions, retriever, str(path))  # before loading any model
    rag = _rag(args, retriever)
    print(f"{len(questions)} questions ({args.split}) from {path}; index {args.index}")
    print(f"{'mode':8} {'recall@1':>9} {'recall@3':>9} {'recall@5':>9} {'MRR@10':>7}")
    for mode in retriever.modes:
        s = retrieval_scores(retriever, questions, mode, (1, 3, 5))
        print(f"{mode:8} {s['recall@1']:9.3f} {s['recall@3']:9.3f} {s['recall@5']:9.3f} "
              f"{s['mrr@10']:7.3f}")  # fmt: skip
    summary, rows = answer_scores(rag, questions)
    label = "generated by " + args.model if args.model else "EXTRACTIVE baseline (no --model)"
    print(
        f"answers ({label}; {rag.mode}, k={rag.k}): exact match {summary['exact_match']:.3f}  "
        f"F1 {summary['f1']:.3f}  gold topic in passages {summary['gold_in_passages']:.3f}  "
        f"cited {summary['cites_gold']:.3f}"
    )
    if args.out:
        write_json(args.out, {"summary": summary, "answers": rows})
    return 0
