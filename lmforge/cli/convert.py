"""`lmforge convert`: Hugging Face checkpoint <-> lmforge checkpoint.

--from-hf SRC --out DST   read an HF directory (llama, mistral, qwen2, mixtral, gpt2), write ours
--to-hf SRC --out DST     read any checkpoint LM.load reads, write an HF directory that
                          transformers' from_pretrained loads unchanged
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert checkpoints between Hugging Face and lmforge layouts",
        description="Convert a Hugging Face checkpoint directory to lmforge (--from-hf) or an "
        "lmforge checkpoint to a Hugging Face directory (--to-hf).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="SRC", help="Hugging Face model directory to read")
    src.add_argument("--to-hf", metavar="SRC", help="lmforge checkpoint directory to export")
    p.add_argument("--out", required=True, metavar="DST", help="directory to write")
    p.add_argument(
        "--max-shard-mb",
        type=float,
        default=None,
        help="--to-hf: split weights into shards of at most this many MiB (default: one file)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from tqdm import tqdm

    from lmforge.lm import LM

    steps = tqdm(total=2, desc="convert", unit="step")
    lm = LM.load(args.from_hf or args.to_hf)
    steps.update()
    if args.from_hf:
        lm.save(args.out)
    else:
        shard = None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20)
        lm.export_hf(args.out, max_shard_bytes=shard)
    steps.update()
    steps.close()
    from lmforge.interop.hf import choose_family

    kind = "lmforge" if args.from_hf else choose_family(lm.config).model_type
    print(f"wrote {args.out} ({lm.model.num_parameters():,} parameters, {kind} layout)")
    return 0
