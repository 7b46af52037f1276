"""`lmforge seq2seq`: train the encoder-decoder on the built-in number task, and translate (the
trainer: lmforge/train/seq2seq.py).

lmforge seq2seq train --out_dir out/numbers --max_iters 1500          # words -> digits
lmforge seq2seq train --reverse true --out_dir out/words          # digits -> words
lmforge seq2seq translate --checkpoint out/numbers "three hundred twelve"
"""

from __future__ import annotations

from lmforge.cli.main import add_run_parser, config_from_args


def register(sub) -> None:
    p = sub.add_parser("seq2seq", help="encoder-decoder translation on the built-in number task")
    s = p.add_subparsers(dest="seq2seq_command", metavar="ACTION", required=True)
    add_run_parser(
        s, "train", "Seq2SeqTrainConfig", run_seq2seq_train, model="model",
        help="train on number words <-> digits and report held-out exact match",
        example="--max_iters 2000 --model.d_model 128",
    )  # fmt: skip
    r = s.add_parser("translate", help="translate with a trained checkpoint")
    r.add_argument("--checkpoint", required=True, help="directory written by `seq2seq train`")
    r.add_argument("--beam", type=int, default=1, help="beam width (1 = greedy)")
    r.add_argument("text", nargs="+", help="sources, e.g. 'three hundred twelve' or 312")
    r.set_defaults(func=run_translate)


def run_seq2seq_train(args) -> int:
    from lmforge.train.seq2seq import Seq2SeqTrainConfig, Seq2SeqTrainer

    cfg = config_from_args(args, Seq2SeqTrainConfig)
    result = Seq2SeqTrainer(cfg, resume=args.resume).run()
    print(f"\nheld-out exact match: greedy {result['test_exact']:.2%}"
          + (f", beam {cfg.beam} {result['test_exact_beam']:.2%}" if cfg.beam > 1 else "")
          + f"\ncheckpoint: {cfg.out_dir}")  # fmt: skip
    return 0


def run_translate(args) -> int:
    import torch

    from lmforge.errors import ConfigError
    from lmforge.train.seq2seq import load

    model, task = load(args.checkpoint)
    for text in args.text:
        tokens = text.split() if not task.reverse else list(text.strip())
        if unknown := [t for t in tokens if t not in task.index]:
            raise ConfigError(f"unknown token(s) {unknown} in {text!r}")
        src = torch.tensor([[task.index[t] for t in tokens]])
        out = model.beam_search(src, args.beam) if args.beam > 1 else model.greedy(src)
        print(f"{text} -> {task.decode(out[0])}")
    return 0
