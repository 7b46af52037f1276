"""SentenceEncoder vs sentence-transformers: encode speed on the same texts and threads.

Both encode the same chunks of the Python reference docs with batch size 32 and normalised
outputs, alternating runs (ours, theirs, ours, ...) so machine load hits both alike; the median
of --repeats runs is reported, with the ratio theirs/ours (> 1 means we are faster) and the
lowest cosine similarity between the two embeddings of each text.

    python benchmarks/bench_encoder.py [--texts 256 --threads 2 --repeats 3]
"""

import os
import statistics
import time

import torch
from bench_cli import options

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    numbers = {"--texts": 256, "--threads": 2, "--repeats": 3, "--batch-size": 32}
    args = options(__doc__.split("\n")[0], numbers).parse_args()
    torch.set_num_threads(args.threads)

    from sentence_transformers import SentenceTransformer

    from lmforge.retrieval import SentenceEncoder, chunk_corpus
    from lmforge.retrieval.encoder import bundled_model_dir

    chunks, _ = chunk_corpus("builtin:pydoc", 120, 30)
    step = max(1, len(chunks) // args.texts)
    texts = [c.text for c in chunks[::step][: args.texts]]
    ours = SentenceEncoder.load(None)
    theirs = SentenceTransformer(str(bundled_model_dir()), device="cpu")

    def run_ours():
        return ours.encode(texts, batch_size=args.batch_size)

    def run_theirs():
        return theirs.encode(
            texts, batch_size=args.batch_size, convert_to_tensor=True, normalize_embeddings=True
        )

    a, b = run_ours(), run_theirs()  # warm-up, and the parity check
    cos = torch.nn.functional.cosine_similarity(a, b.float().cpu(), dim=-1)
    times = {"ours": [], "sentence-transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", run_ours), ("sentence-transformers", run_theirs)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{len(texts)} texts, {args.threads} thread(s), batch {args.batch_size}, "
          f"median of {args.repeats} alternating runs")  # fmt: skip
    for name, t in med.items():
        runs = ", ".join(f"{x:.2f}" for x in times[name])
        print(f"{name:22} {t:7.2f} s  ({len(texts) / t:6.1f} texts/s; runs {runs})")
    print(
        f"speed ratio sentence-transformers/ours = {med['sentence-transformers'] / med['ours']:.3f}"
    )
    print(f"min cosine(ours, sentence-transformers) = {cos.min().item():.6f}")


if __name__ == "__main__":
    main()
