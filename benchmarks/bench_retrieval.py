"""Retrieval benchmark on the built-in Python reference docs (pydoc_data.topics).

For each labelled query in retrieval_queries.jsonl, a query is recalled at 5 when a chunk of
any topic that answers it is among the top 5 results (the labels are alternatives: each of them
answers the question). Prints recall@5 and MRR@10 for BM25, dense and RRF-hybrid, the median
query latency of each, and the index build time (chunking, BM25, embeddings).

    python benchmarks/bench_retrieval.py [--chunk-size 120 --overlap 30 --rrf-k 60 --depth 50]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lmforge.retrieval import SEARCH_MODES, Retriever, SentenceEncoder, chunk_corpus

HERE = Path(__file__).parent


def load_queries(path: Path) -> list[dict]:
    from pydoc_data.topics import topics

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        missing = [t for t in row["topics"] if t not in topics]
        if missing:
            print(f"note: topics {missing} not in this Python's pydoc_data ({row['query']!r})")
    return rows


def evaluate(retriever: Retriever, queries: list[dict], mode: str, k: int = 5):
    hits, rr, times = 0, 0.0, []
    for q in queries:
        t0 = time.perf_counter()
        results = retriever.search(q["query"], 10, mode)
        times.append(time.perf_counter() - t0)
        sources = [h.chunk.source.removeprefix("pydoc:") for h in results]
        good = [i for i, s in enumerate(sources) if s in q["topics"]]
        hits += bool(good and good[0] < k)
        rr += 1 / (good[0] + 1) if good else 0.0
    n = len(queries)
    return hits / n, rr / n, statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk-size", type=int, default=120)
    ap.add_argument("--overlap", type=int, default=30)
    ap.add_argument("--rrf-k", type=float, default=60.0)
    ap.add_argument("--depth", type=int, default=50, help="candidates per ranking for RRF")
    ap.add_argument("--queries", default=str(HERE / "retrieval_queries.jsonl"))
    # One thread by default: on a shared, loaded machine a 2-thread OpenMP barrier turns each
    # tiny query-time op into a ~20 ms wait for a descheduled thread (measured: 1.4 s vs 30 ms).
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    queries = load_queries(Path(args.queries))

    t0 = time.perf_counter()
    chunks, corpus = chunk_corpus("builtin:pydoc", args.chunk_size, args.overlap)
    t1 = time.perf_counter()
    bm25_only = Retriever.build(chunks, encoder=None)
    t2 = time.perf_counter()
    encoder = SentenceEncoder.load(None)
    t3 = time.perf_counter()
    retriever = Retriever.build(chunks, encoder, "all-MiniLM-L6-v2")
    t4 = time.perf_counter()
    retriever.rrf_k, retriever.fusion_depth = args.rrf_k, args.depth
    del bm25_only
    print(
        f"corpus: {len(corpus.documents)} topics -> {len(chunks)} chunks "
        f"({args.chunk_size} words, overlap {args.overlap}); {len(queries)} queries; "
        f"{args.threads} thread(s)"
    )
    print(
        f"build: chunking {t1 - t0:.2f}s  BM25 {t2 - t1:.2f}s  encoder load {t3 - t2:.2f}s  "
        f"BM25+embeddings {t4 - t3:.1f}s"
    )
    print(f"{'mode':8} {'recall@5':>9} {'MRR@10':>7} {'latency ms':>11}")
    recall = {}
    for mode in SEARCH_MODES:
        recall[mode], mrr, ms = evaluate(retriever, queries, mode)
        print(f"{mode:8} {recall[mode]:9.3f} {mrr:7.3f} {ms:11.2f}")
    best = max(recall["bm25"], recall["dense"])
    verdict = "OK" if recall["hybrid"] >= best else "BELOW"
    print(f"hybrid vs better single retriever: {recall['hybrid']:.3f} vs {best:.3f} ({verdict})")


if __name__ == "__main__":
    main()
