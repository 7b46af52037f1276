"""`lmforge eval TASK`: evaluate a checkpoint (perplexity for now)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint")
    esub = p.add_subparsers(dest="task", metavar="TASK", required=True)
    ppl = esub.add_parser("perplexity", help="perplexity and bits-per-byte on a text corpus")
    ppl.add_argument("--checkpoint", required=True)
    ppl.add_argument("--data", required=True, help="file, folder, .jsonl, builtin:NAME")
    ppl.add_argument("--window", type=int, default=None, help="context tokens (max_seq_len)")
    ppl.add_argument("--stride", type=int, default=None, help="window step (default: window)")
    ppl.add_argument("--device", default="cpu")
    ppl.set_defaults(func=run_perplexity)


def run_perplexity(args) -> int:
    from lmforge.data import read_documents
    from lmforge.errors import ConfigError
    from lmforge.eval.perplexity import perplexity
    from lmforge.lm import LM

    lm = LM.load(args.checkpoint, device=args.device)
    if lm.tokenizer is None:
        raise ConfigError(f"{args.checkpoint}: no tokenizer.json, cannot tokenize {args.data}")
    ids: list[int] = []
    n_bytes = 0
    eos = lm.tokenizer.eos_id
    for doc in read_documents(args.data):
        ids += lm.tokenizer.encode(doc) + ([eos] if eos is not None else [])
        n_bytes += len(doc.encode("utf-8"))
    print(perplexity(lm.model, ids, n_bytes, args.window, args.stride))
    return 0
