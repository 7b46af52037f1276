"""`lmforge tokenizer train`: train a BPE / char / word tokenizer and save tokenizer.json."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("tokenizer", help="train or inspect tokenizers")
    tsub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    t = tsub.add_parser("train", help="train a tokenizer on a corpus")
    t.add_argument("--data", default="builtin:pydoc", help="file, folder, .jsonl, builtin:NAME")
    t.add_argument("--kind", choices=["bpe", "char", "word"], default="bpe")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--text-field", default="text", help="JSONL/Parquet field holding the text")
    t.add_argument("--out", required=True, help="output directory (tokenizer.json written there)")
    t.set_defaults(func=run_tokenizer_train)
    e = tsub.add_parser("encode", help="show the tokens of a text")
    e.add_argument("--tokenizer", required=True, help="directory or tokenizer.json")
    e.add_argument("text")
    e.set_defaults(func=run_encode)


def run_tokenizer_train(args) -> int:
    import sys

    from lmforge.data import read_documents
    from lmforge.train.pretrain import train_tokenizer

    docs = read_documents(args.data, text_field=args.text_field)
    # the tokenizers library's own bar redraws with carriage returns: on a terminal only
    tok = train_tokenizer(args.kind, docs, args.vocab_size, show_progress=sys.stderr.isatty())
    tok.save(args.out)
    print(f"{args.kind} tokenizer with {tok.vocab_size:,} tokens saved to {args.out}")
    return 0


def run_encode(args) -> int:
    from lmforge.tokenizer import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    ids = tok.encode(args.text)
    print(ids)
    print([tok.id_to_token(i) for i in ids])
    return 0
