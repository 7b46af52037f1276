"""`lmforge rag index` / `lmforge rag ask`: build a retrieval index, then answer with sources.

    lmforge rag index --out runs/pydoc-index                  # the Python reference docs
    lmforge rag ask --index runs/pydoc-index --question "How do I leave a loop early?"
    lmforge rag ask --index runs/pydoc-index --question "..." --checkpoint out/run1

Without --checkpoint the answer is extractive (retrieved sentences with their sources).
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
    ask.add_argument("--checkpoint", default=None, help="LM to generate with (default: extract)")
    ask.add_argument("--k", type=int, default=5, help="chunks to retrieve")
    ask.add_argument("--mode", default="hybrid", choices=["bm25", "dense", "hybrid"])
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--temperature", type=float, default=0.0)
    ask.add_argument("--device", default="cpu")
    ask.set_defaults(func=run_ask)


def run_index(args) -> int:
    from lmforge.retrieval import Retriever, chunk_corpus

    t0 = time.perf_counter()
    chunks, corpus = chunk_corpus(args.corpus, args.chunk_size, args.overlap, args.unit)
    if corpus.skipped:
        print(f"warning: {corpus.skip_message()}", file=sys.stderr)
    encoder = None if args.encoder.lower() == "none" else args.encoder
    settings = {
        "corpus": str(args.corpus),
        "chunk_size": args.chunk_size,
        "overlap": args.overlap,
        "unit": args.unit,
    }
    retriever = Retriever.build(chunks, encoder, None, args.batch_size, settings, progress=True)
    retriever.save(args.out)
    print(
        f"indexed {len(chunks)} chunks from {len(corpus.documents)} documents "
        f"({', '.join(retriever.modes)}) in {time.perf_counter() - t0:.1f}s -> {args.out}"
    )
    return 0


def run_ask(args) -> int:
    from lmforge.retrieval import RAG, Retriever

    retriever = Retriever.load(args.index)
    lm = None
    if args.checkpoint:
        from lmforge.lm import LM

        lm = LM.load(args.checkpoint, device=args.device)
    rag = RAG(
        retriever,
        lm,
        k=args.k,
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    print(rag.ask(args.question).format())
    return 0
