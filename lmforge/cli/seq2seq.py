"""`lmforge seq2seq`: train the encoder-decoder on the built-in number task, and translate.

lmforge seq2seq train --out_dir out/numbers --steps 1500          # words -> digits
lmforge seq2seq train --reverse true --out_dir out/words          # digits -> words
lmforge seq2seq translate --checkpoint out/numbers "three hundred twelve"
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError, require_positive_ints


@dataclass
class Seq2SeqTrainConfig:
    """A run on NumberTask. `model` holds Seq2SeqConfig fields (vocab comes from the task)."""

    out_dir: str = "out/seq2seq"
    reverse: bool = False  # False: words -> digits; True: digits -> words
    max_number: int = 10000
    test_fraction: float = 0.1
    steps: int = 1500
    batch_size: int = 64
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 50
    eval_interval: int = 250
    beam: int = 4  # beam width for the final evaluation (1 = greedy only)
    seed: int = 0
    threads: int | None = 1  # torch threads; 1 avoids oversubscription on shared CPUs
    progress: bool = True
    model: dict[str, Any] = field(default_factory=lambda: {"d_model": 64, "d_ff": 256, "n_head": 4})

    def __post_init__(self) -> None:
        require_positive_ints(self, "steps", "batch_size", "max_number", "eval_interval", "beam")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"test_fraction must be in (0, 1), got {self.test_fraction}")


def register(sub) -> None:
    p = sub.add_parser("seq2seq", help="encoder-decoder translation on the built-in number task")
    s = p.add_subparsers(dest="seq2seq_command", metavar="ACTION", required=True)
    t = s.add_parser(
        "train",
        help="train on number words <-> digits and report held-out exact match",
        description="Any Seq2SeqTrainConfig field can be given as --key value (model fields "
        "as --model.KEY value), e.g. --steps 2000 --model.d_model 128.",
    )
    t.add_argument("--config", help="YAML file of Seq2SeqTrainConfig fields (optional)")
    t.set_defaults(func=run_train, accepts_overrides=True)
    r = s.add_parser("translate", help="translate with a trained checkpoint")
    r.add_argument("--checkpoint", required=True, help="directory written by `seq2seq train`")
    r.add_argument("--beam", type=int, default=1, help="beam width (1 = greedy)")
    r.add_argument("text", nargs="+", help="sources, e.g. 'three hundred twelve' or 312")
    r.set_defaults(func=run_translate)


def train(cfg: Seq2SeqTrainConfig, log=print) -> dict[str, float]:
    """Train, evaluate exact match on held-out numbers, save weights + config + metrics."""
    import torch
    from tqdm import tqdm

    from lmforge.fileio import remove_stale_temps, save_tensors, write_json
    from lmforge.model.seq2seq import NumberTask, Seq2Seq, Seq2SeqConfig
    from lmforge.train.metrics import MetricsLog
    from lmforge.train.optim import cosine_lr

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out_dir)
    task = NumberTask(cfg.max_number, cfg.test_fraction, cfg.seed, cfg.reverse)
    try:
        model_cfg = Seq2SeqConfig(**{**cfg.model, "vocab_size": len(task.vocab)})
    except TypeError as err:
        raise ConfigError(f"model: {err}") from err
    model = Seq2Seq(model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    remove_stale_temps(out)  # temps of saves killed mid-write in an earlier run
    metrics = MetricsLog(out)
    rng = random.Random(cfg.seed)
    dev = rng.sample(task.train, min(500, len(task.train)))  # seen numbers, for the curve
    result: dict[str, float] = {}
    for step in tqdm(range(1, cfg.steps + 1), disable=not cfg.progress, unit="step"):
        lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        model.train()
        loss = model.loss(*task.batch(rng.sample(task.train, cfg.batch_size)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if not math.isfinite(loss.item()):
            raise ConfigError(f"loss became {loss.item()} at step {step}; lower lr")
        if step % 10 == 0:
            metrics.log(step, "train", loss=loss.item(), lr=lr)
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            result = {"train_exact": task.translation_accuracy(model, dev),
                      "test_exact": task.translation_accuracy(model, task.test)}  # fmt: skip
            metrics.log(step, "eval", **result)
            log(f"step {step}: loss {loss.item():.4f}  held-out exact match "
                f"{result['test_exact']:.2%}")  # fmt: skip
    if cfg.beam > 1:
        result["test_exact_beam"] = task.translation_accuracy(model, task.test, beam=cfg.beam)
    save_tensors(out / "model.safetensors", model.state_dict())
    meta = {**model_cfg.to_dict(), "model_type": "lmforge-seq2seq"}
    meta["task"] = {"reverse": cfg.reverse, "vocab": task.vocab}
    write_json(out / "config.json", meta)
    write_json(out / "train_config.json", asdict(cfg))
    write_json(out / "final_metrics.json", result)
    metrics.plot([("train", "loss"), ("eval", "test_exact")], out / "loss.png", title="seq2seq")
    metrics.close()
    return result


def load(checkpoint: str):
    """(model, task) from a directory written by `train`."""
    from lmforge.fileio import load_tensors, read_json
    from lmforge.model.seq2seq import NumberTask, Seq2Seq, Seq2SeqConfig

    meta = read_json(Path(checkpoint) / "config.json", "seq2seq config")
    task_meta = meta.pop("task")
    meta.pop("model_type", None)
    model = Seq2Seq(Seq2SeqConfig(**meta))
    model.load_state_dict(load_tensors(Path(checkpoint) / "model.safetensors"))
    task = NumberTask(reverse=task_meta["reverse"])
    return model.eval(), task


def run_train(args) -> int:
    from lmforge.train.config import build_config, parse_overrides

    cfg = build_config(Seq2SeqTrainConfig, args.config, parse_overrides(args.overrides))
    result = train(cfg)
    print(f"\nheld-out exact match: greedy {result['test_exact']:.2%}"
          + (f", beam {cfg.beam} {result['test_exact_beam']:.2%}" if cfg.beam > 1 else "")
          + f"\ncheckpoint: {cfg.out_dir}")  # fmt: skip
    return 0


def run_translate(args) -> int:
    import torch

    model, task = load(args.checkpoint)
    for text in args.text:
        tokens = text.split() if not task.reverse else list(text.strip())
        unknown = [t for t in tokens if t not in task.index]
        if unknown:
            raise ConfigError(f"unknown token(s) {unknown} in {text!r}")
        src = torch.tensor([[task.index[t] for t in tokens]])
        out = model.beam_search(src, args.beam) if args.beam > 1 else model.greedy(src)
        print(f"{text} -> {task.decode(out[0])}")
    return 0
