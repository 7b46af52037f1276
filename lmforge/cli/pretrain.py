"""`lmforge pretrain`: train a tokenizer (if needed) and a model from a YAML config."""

from __future__ import annotations

from lmforge.train.config import TrainConfig, build_config, parse_overrides


def register(sub) -> None:
    p = sub.add_parser(
        "pretrain",
        help="pretrain a causal LM",
        description="Pretrain a causal LM. Any TrainConfig field can be overridden with "
        "--key value (model fields as --model.KEY value), e.g. --max_iters 500 --model.n_layer 6.",
    )
    p.add_argument("--config", help="YAML file of TrainConfig fields (optional)")
    p.add_argument("--resume", action="store_true", help="continue from out_dir's training state")
    p.add_argument(
        "--objective",
        choices=("clm", "mlm", "mlm+nsp"),
        default="clm",
        help="clm: causal LM (default); mlm / mlm+nsp: a BERT encoder (masked LM, plus next-"
        "sentence prediction), fields of lmforge.train.encoder.EncoderTrainConfig",
    )
    p.set_defaults(func=run, accepts_overrides=True)


def run(args) -> int:
    if args.objective != "clm":
        return run_encoder(args)
    from lmforge.train.pretrain import Pretrainer

    cfg = build_config(TrainConfig, args.config, parse_overrides(args.overrides))
    trainer = Pretrainer(cfg, resume=args.resume)
    result = trainer.run()
    print(
        f"\nfinal: step {result['step']}  val loss {result['val_loss']:.4f}  "
        f"val perplexity {result['val_ppl']:.2f}  "
        f"{result['tokens_per_s']:,.0f} tokens/s  {result['elapsed_s']:.1f} s training"
    )
    for i, text in enumerate(trainer.samples()):
        print(f"\n--- sample {i + 1} ---\n{text}")
    print(f"\ncheckpoint: {cfg.out_dir}   loss plot: {result['plot']}")
    print(f"try: lmforge generate --checkpoint {cfg.out_dir} --prompt 'The '")
    return 0


def run_encoder(args) -> int:
    from lmforge.train.encoder import EncoderPretrainer, EncoderTrainConfig

    overrides = parse_overrides(args.overrides) | {"objective": args.objective}
    cfg = build_config(EncoderTrainConfig, args.config, overrides)
    result = EncoderPretrainer(cfg, resume=args.resume).run()
    parts = "  ".join(f"val {k} {v:.4f}" for k, v in result.items() if k[:3] in ("mlm", "nsp"))
    print(f"\nfinal: step {result['step']}  {parts}  {result['elapsed_s']:.1f} s training")
    print(f"\nBERT checkpoint (Hugging Face layout): {cfg.out_dir}   plot: {result['plot']}")
    print(f"try: lmforge classify train --checkpoint {cfg.out_dir}")
    return 0
