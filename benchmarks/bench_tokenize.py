"""Streaming corpus tokenisation: MB/s with 1 and 2 worker processes, and peak resident memory.

Generates a JSONL corpus of >= --mb MB by repeating the built-in pydoc corpus (~465 KB) with
variations (shuffled order, a numbered header, numbered word variants), trains a 2048-token BPE on
the original, then times build_token_shards(workers=1|2) in fresh child processes, alternating
1 and 2, median of --repeats. Peak RSS is the child's own (reader + writer) and its largest
worker's. A quarter-size corpus run shows memory does not grow with the corpus.

    python benchmarks/bench_tokenize.py            # 100 MB, 3 repeats
    python benchmarks/bench_tokenize.py --mb 20 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_corpus(path: Path, target_mb: float, seed: int = 0) -> int:
    """Write pydoc copies with variations until target_mb of text; return the text bytes."""
    from lmforge.data import builtin_corpus

    docs = builtin_corpus("pydoc")
    rng = random.Random(seed)
    words = ["the", "function", "object", "value", "module", "class"]
    total, copy = 0, 0
    with open(path, "w", encoding="utf-8") as fh:
        while total < target_mb * 1e6:
            order = list(range(len(docs)))
            rng.shuffle(order)
            for i in order:
                text = f"Copy {copy}, topic {i}\n" + docs[i]
                word = rng.choice(words)
                text = text.replace(f" {word} ", f" {word}{rng.randrange(100)} ")
                fh.write(json.dumps({"text": text}) + "\n")
                total += len(text.encode("utf-8"))
            copy += 1
    return total


def child(corpus: str, tokenizer_dir: str, workers: int) -> None:
    """One measured build, in a fresh process so ru_maxrss is this build's alone."""
    from lmforge.data import build_token_shards, read_documents
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer.load(tokenizer_dir)
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        meta = build_token_shards(
            read_documents(corpus), tok, out, workers=workers, progress=False, batch_docs=256
        )
        seconds = time.perf_counter() - t0
    kib = 1024  # ru_maxrss is KiB on Linux
    print(json.dumps({
        "seconds": seconds,
        "tokens": meta["train_tokens"] + meta["val_tokens"],
        "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib / 1e6,
        "rss_worker_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib / 1e6,
    }))  # fmt: skip


def measure(corpus: Path, tokenizer_dir: Path, workers: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(corpus), str(tokenizer_dir), str(workers)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MB of text")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        corpus, tok_dir, workers = args.child
        child(corpus, tok_dir, int(workers))
        return

    from lmforge.data import builtin_corpus
    from lmforge.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        Tokenizer.train_bpe(builtin_corpus("pydoc"), vocab_size=2048).save(tmp / "tok")
        sizes = {"full": write_corpus(tmp / "full.jsonl", args.mb)}
        sizes["quarter"] = write_corpus(tmp / "quarter.jsonl", args.mb / 4)
        print(f"corpus: {sizes['full'] / 1e6:.1f} MB of text (JSONL), quarter: "
              f"{sizes['quarter'] / 1e6:.1f} MB; BPE vocab 2048")  # fmt: skip
        runs: dict[int, list[dict]] = {1: [], 2: []}
        for r in range(args.repeats):
            for workers in (1, 2) if r % 2 == 0 else (2, 1):  # alternate: shared, noisy machine
                runs[workers].append(measure(tmp / "full.jsonl", tmp / "tok", workers))
        rates = {}
        for workers, rs in runs.items():
            secs = statistics.median(x["seconds"] for x in rs)
            rates[workers] = sizes["full"] / 1e6 / secs
            main_mb = max(x["rss_main_mb"] for x in rs)
            worker_mb = max(x["rss_worker_mb"] for x in rs) if workers > 1 else 0.0
            print(f"workers={workers}: {rates[workers]:6.2f} MB/s (median of {len(rs)}, "
                  f"{secs:.1f} s, {rs[0]['tokens']:,} tokens); peak RSS main {main_mb:.0f} MB"
                  + (f", per worker {worker_mb:.0f} MB" if workers > 1 else ""))  # fmt: skip
        print(f"speed-up 2 workers / 1 worker: {rates[2] / rates[1]:.2f}x")
        for workers in (1, 2):
            q = measure(tmp / "quarter.jsonl", tmp / "tok", workers)
            print(f"memory vs corpus size, workers={workers}: peak RSS main {q['rss_main_mb']:.0f}"
                  f" MB at {sizes['quarter'] / 1e6:.0f} MB vs "
                  f"{max(x['rss_main_mb'] for x in runs[workers]):.0f} MB at "
                  f"{sizes['full'] / 1e6:.0f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
