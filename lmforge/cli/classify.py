"""`lmforge classify`: fine-tune a BERT checkpoint for sequence classification, and predict
(the trainer: lmforge/train/classify.py).

lmforge pretrain --objective mlm --out_dir out/bert                  # an encoder to start from
lmforge classify train --checkpoint out/bert --out_dir out/sentiment # built-in demo task
lmforge classify train --checkpoint out/bert --data reviews.jsonl    # {"text": ..., "label": ...}
lmforge classify predict --checkpoint out/sentiment "the plot was not dull"
"""

from __future__ import annotations

import math

from lmforge.cli.main import add_run_parser, config_from_args


def register(sub) -> None:
    p = sub.add_parser("classify", help="fine-tune a BERT encoder for text classification")
    s = p.add_subparsers(dest="classify_command", metavar="ACTION", required=True)
    add_run_parser(
        s, "train", "ClassifyTrainConfig", run_classify_train,
        help="fine-tune on labelled .jsonl (or the built-in demo task); report accuracy",
        example="--checkpoint out/bert --data train.jsonl --max_iters 500 --lr 1e-4",
    )  # fmt: skip
    r = s.add_parser("predict", help="label texts with a fine-tuned checkpoint")
    r.add_argument("--checkpoint", required=True, help="directory written by `classify train`")
    r.add_argument("--data", help=".jsonl with a text field (and labels: accuracy is reported)")
    r.add_argument("--text_field", default="text")
    r.add_argument("--label_field", default="label")
    r.add_argument("text", nargs="*", help="texts to label")
    r.set_defaults(func=run_predict)


def run_classify_train(args) -> int:
    from lmforge.train.classify import ClassifyTrainConfig, ClassifyTrainer

    cfg = config_from_args(args, ClassifyTrainConfig)
    result = ClassifyTrainer(cfg, resume=args.resume).run()
    before = result.get("val_acc_before", math.nan)  # absent when resumed
    print(f"\nval accuracy: {before:.1%} before -> {result['val_acc']:.1%} "
          f"after fine-tuning (train {result['train_acc']:.1%})")  # fmt: skip
    print(f"checkpoint: {cfg.out_dir}   plot: {result['plot']}")
    print(f'try: lmforge classify predict --checkpoint {cfg.out_dir} "the plot was not dull"')
    return 0


def run_predict(args) -> int:
    from lmforge.errors import ConfigError
    from lmforge.train.classify import predict, read_labelled

    texts, labels = list(args.text), []
    if args.data:
        rows = read_labelled(args.data, args.text_field, args.label_field)
        texts, labels = texts + [t for t, _ in rows], [y for _, y in rows]
    if not texts:
        raise ConfigError("give texts to label, or --data FILE.jsonl")
    preds = predict(args.checkpoint, texts)
    for text, (_, name, prob) in zip(texts, preds):
        print(f"{name}\t{prob:.3f}\t{text}")
    if labels:
        # integer gold labels are class indices, string ones class names
        scored = preds[len(args.text) :]
        pairs = zip(scored, labels)
        correct = sum(
            gold == (i if isinstance(gold, int) else name) for (i, name, _), gold in pairs
        )
        print(f"accuracy: {correct / len(labels):.1%} on {len(labels)} labelled examples")
    return 0
