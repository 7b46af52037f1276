"""`lmforge pretrain`: train a tokenizer (if needed) and a model from a YAML config."""

from __future__ import annotations

from lmforge.cli.main import add_run_parser, config_from_args


def register(sub) -> None:
    p = add_run_parser(
        sub, "pretrain", "TrainConfig", run, model="model", lead="Pretrain a causal LM. ",
        help="pretrain a causal LM", example="--max_iters 500 --model.n_layer 6",
    )  # fmt: skip
    p.add_argument(
        "--objective", choices=("clm", "mlm", "mlm+nsp"), default="clm",
        help="clm: causal LM (default); mlm / mlm+nsp: a BERT encoder (masked LM, plus next-"
        "sentence prediction), fields of lmforge.train.encoder.EncoderTrainConfig",
    )  # fmt: skip


def run(args) -> int:
    if args.objective != "clm":
        return run_encoder(args)
    from lmforge.model.config import ModelConfig
    from lmforge.train.config import TrainConfig
    from lmforge.train.pretrain import Pretrainer

    cfg = config_from_args(args, TrainConfig)
    validate(cfg, ModelConfig, cfg.model_config)
    trainer = Pretrainer(cfg, resume=args.resume)
    result = trainer.run()
    parts = [
        f"\nfinal: step {result['step']}", f"val loss {result['val_loss']:.4f}",
        f"val perplexity {result['val_ppl']:.2f}", f"val bits/byte {result['val_bpb']:.4f}",
        f"{result['tokens_per_s']:,.0f} tokens/s",
    ]  # fmt: skip
    if "mfu" in result:  # a GPU of PEAK_BF16_TFLOPS, or --peak_tflops
        parts.append(f"MFU {result['mfu']:.1%}")
    if "tokens_per_s_after_warmup" in result:  # the steady rate, without compilation
        mfu = result.get("mfu_after_warmup")
        parts.append(
            f"(after the first {result['warmup_steps']} steps: "
            f"{result['tokens_per_s_after_warmup']:,.0f} tokens/s"
            + (f", MFU {mfu:.1%})" if mfu is not None else ")")
        )
    parts.append(f"{result['elapsed_s']:.1f} s training")
    if "cuda_peak_gib" in result:
        parts.append(f"GPU memory peak {result['cuda_peak_gib']:.1f} GiB")
    print("  ".join(parts))
    for loss, m in result["milestones"].items():
        print(f"val loss <= {loss}: step {m['step']}, {m['seconds']:.1f} s after start")
    for loss in cfg.loss_milestones:
        if f"{loss:g}" not in result["milestones"]:
            print(f"val loss <= {loss:g}: not reached")
    for i, text in enumerate(trainer.samples()):
        print(f"\n--- sample {i + 1} ---\n{text}")
    print(f"\ncheckpoint: {cfg.out_dir}   loss plot: {result['plot']}")
    print(f"try: lmforge generate --checkpoint {cfg.out_dir} --prompt 'The '")
    return 0


def run_encoder(args) -> int:
    from lmforge.model.bert import BertConfig
    from lmforge.train.encoder import EncoderPretrainer, EncoderTrainConfig

    cfg = config_from_args(args, EncoderTrainConfig, {"objective": args.objective})
    validate(cfg, BertConfig, cfg.bert_config)
    result = EncoderPretrainer(cfg, resume=args.resume).run()
    parts = "  ".join(f"val {k} {v:.4f}" for k, v in result.items() if k[:3] in ("mlm", "nsp"))
    print(f"\nfinal: step {result['step']}  {parts}  {result['elapsed_s']:.1f} s training")
    print(f"\nBERT checkpoint (Hugging Face layout): {cfg.out_dir}   plot: {result['plot']}")
    print(f"try: lmforge classify train --checkpoint {cfg.out_dir}")
    return 0


def validate(cfg, model_class: type, build_model_config) -> None:
    """Check what the trainer would otherwise find only after writing the tokenizer and token
    shards into out_dir: the device, and the `model_class` config `build_model_config` makes from
    the run's settings (a preset name, `model:` fields and their types). The vocabulary size is
    a stand-in here (the tokenizer is not built yet); no model rule depends on its value."""
    from lmforge.errors import check_field_types, require_device

    require_device(cfg.device)
    check_field_types(model_class, cfg.model, "model")
    build_model_config(cfg.vocab_size)
