"""`lmforge convert`: checkpoints between the Hugging Face, GGUF and lmforge layouts.

--from-hf SRC --out DST   read an HF directory (llama, mistral, qwen2, mixtral, gpt2), write ours
--to-hf SRC --out DST     read any checkpoint LM.load reads, write an HF directory that
                          transformers' from_pretrained loads unchanged
--from-gguf FILE --out DST                 read a llama.cpp GGUF (dequantised), write ours
--to-gguf OUT.gguf --checkpoint SRC [--dtype f16|bf16|q8_0]
                          write a llama-architecture model as GGUF for llama.cpp / Ollama
"""

from __future__ import annotations

from pathlib import Path

from lmforge.errors import ConfigError
from lmforge.fileio import write_json


def register(sub) -> None:
    import argparse

    p = sub.add_parser(
        "convert", help="convert checkpoints between Hugging Face, GGUF and lmforge layouts",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="SRC", help="Hugging Face model directory to read")
    src.add_argument("--to-hf", metavar="SRC", help="lmforge checkpoint directory to export")
    src.add_argument("--from-gguf", metavar="FILE", help="GGUF file to read (llama.cpp / Ollama)")
    src.add_argument(
        "--to-gguf", metavar="OUT", help="GGUF file to write from --checkpoint (llama architecture)"
    )
    p.add_argument("--out", metavar="DST", help="directory to write (all but --to-gguf)")
    p.add_argument("--checkpoint", metavar="SRC", help="--to-gguf: checkpoint LM.load reads")
    p.add_argument("--dtype", choices=("f16", "bf16", "q8_0"), default="f16",
                   help="--to-gguf: weight type (1-D tensors stay f32; default: f16)")  # fmt: skip
    p.add_argument("--max-shard-mb", type=float, help="--to-hf: split weights into "
                   "shards of at most this many MiB (default: one file)")  # fmt: skip
    p.set_defaults(func=run)


def _to_gguf(args) -> int:
    from lmforge.interop.gguf_write import export_gguf
    from lmforge.lm import LM

    if not args.checkpoint:
        raise ConfigError("--to-gguf needs --checkpoint (the model to write)")
    lm = LM.load(args.checkpoint, dtype="float32")  # a GGUF source too: dense weights to write
    path = export_gguf(lm, args.to_gguf, dtype=args.dtype)
    n = lm.model.num_parameters()
    print(f"wrote {path} ({n:,} parameters, llama GGUF, {args.dtype})")
    return 0


def run(args) -> int:
    from lmforge.lm import LM
    from lmforge.progress import progress_bar

    if args.to_gguf:
        return _to_gguf(args)
    if not args.out:
        raise ConfigError("--out is required with --from-hf, --to-hf and --from-gguf")
    steps = progress_bar(total=2, desc="convert", unit="step")
    # float32: a GGUF file is read dense (LM.load would keep its own precision, which only
    # inference uses); HF and lmforge checkpoints were read in float32 already
    lm = LM.load(args.from_hf or args.to_hf or args.from_gguf, dtype="float32")
    steps.update()
    if args.to_hf:
        shard = None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20)
        lm.export_hf(args.out, max_shard_bytes=shard)
    else:  # LM.save alone would keep the HF family's layout
        lm.save(args.out, format="lmforge")
        if args.from_gguf and lm.generation_config:
            write_json(Path(args.out) / "generation_config.json", lm.generation_config)
    steps.update()
    steps.close()
    from lmforge.interop.hf import choose_family

    kind = "lmforge" if args.from_hf or args.from_gguf else choose_family(lm.config).model_type
    print(f"wrote {args.out} ({lm.model.num_parameters():,} parameters, {kind} layout)")
    return 0
