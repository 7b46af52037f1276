"""`lmforge seq2seq`: train the encoder-decoder on the built-in number task, and translate.

lmforge seq2seq train --out_dir out/numbers --max_iters 1500          # words -> digits
lmforge seq2seq train --reverse true --out_dir out/words          # digits -> words
lmforge seq2seq translate --checkpoint out/numbers "three hundred twelve"
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError, require_positive_ints
from lmforge.train.config import OptimConfig
from lmforge.train.loop import Trainer


@dataclass
class Seq2SeqTrainConfig(OptimConfig):
    """A run on NumberTask. `model` holds Seq2SeqConfig fields (vocab comes from the task)."""

    out_dir: str = "out/seq2seq"
    reverse: bool = False  # False: words -> digits; True: digits -> words
    max_number: int = 10000
    test_fraction: float = 0.1
    max_iters: int = 1500
    batch_size: int = 64
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_iters: int = 50
    weight_decay: float = 0.01
    beta2: float = 0.999
    beam: int = 4  # beam width for the final evaluation (1 = greedy only)
    seed: int = 0
    threads: int | None = 1  # torch threads; 1 avoids oversubscription on shared CPUs
    model: dict[str, Any] = field(default_factory=lambda: {"d_model": 64, "d_ff": 256, "n_head": 4})

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_ints(self, "batch_size", "max_number", "beam")
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"test_fraction must be in (0, 1), got {self.test_fraction}")


def register(sub) -> None:
    p = sub.add_parser("seq2seq", help="encoder-decoder translation on the built-in number task")
    s = p.add_subparsers(dest="seq2seq_command", metavar="ACTION", required=True)
    t = s.add_parser(
        "train",
        help="train on number words <-> digits and report held-out exact match",
        description="Any Seq2SeqTrainConfig field can be given as --key value (model fields "
        "as --model.KEY value), e.g. --max_iters 2000 --model.d_model 128.",
    )
    t.add_argument("--config", help="YAML file of Seq2SeqTrainConfig fields (optional)")
    t.add_argument("--resume", action="store_true", help="continue from out_dir's saved state")
    t.set_defaults(func=run_train, accepts_overrides=True)
    r = s.add_parser("translate", help="translate with a trained checkpoint")
    r.add_argument("--checkpoint", required=True, help="directory written by `seq2seq train`")
    r.add_argument("--beam", type=int, default=1, help="beam width (1 = greedy)")
    r.add_argument("text", nargs="+", help="sources, e.g. 'three hundred twelve' or 312")
    r.set_defaults(func=run_translate)


class Seq2SeqTrainer(Trainer):
    """Trains the encoder-decoder on random batches of the task's training numbers; exact match
    on held-out numbers every eval_interval steps, with beam search at the end."""

    name = "seq2seq"
    curves = [("train", "loss"), ("eval", "test_exact")]
    plot_file = "loss.png"

    def __init__(self, cfg: Seq2SeqTrainConfig, resume: bool = False, log=print):
        import torch

        from lmforge.model.seq2seq import NumberTask, Seq2Seq, Seq2SeqConfig
        from lmforge.train.distributed import Parallel

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.task = NumberTask(cfg.max_number, cfg.test_fraction, cfg.seed, cfg.reverse)
        try:
            self.model_config = Seq2SeqConfig(**{**cfg.model, "vocab_size": len(self.task.vocab)})
        except TypeError as err:
            raise ConfigError(f"model: {err}") from err
        self.open_run(cfg, Parallel(torch.device("cpu")), resume, log)
        self.model = Seq2Seq(self.model_config)
        self.rng = random.Random(cfg.seed)
        self.dev = self.rng.sample(self.task.train, min(500, len(self.task.train)))  # seen ones
        self.start(self.model)

    def next_batch(self):
        return self.task.batch(self.rng.sample(self.task.train, self.cfg.batch_size))

    def micro_batches(self, batch):
        from lmforge.train.loop import split_rows

        return split_rows(tuple(batch), self.cfg.grad_accum)

    def loss(self, batch):
        return self.model.loss(*batch), {}

    def evaluate(self) -> dict[str, float]:
        score = self.task.translation_accuracy
        return {"train_exact": score(self.model, self.dev),
                "test_exact": score(self.model, self.task.test)}  # fmt: skip

    def eval_line(self, result: dict[str, float]) -> str:
        return f"step {self.step}: held-out exact match {result['test_exact']:.2%}"

    def export(self, path: Path) -> None:
        from lmforge.fileio import save_tensors, write_json

        save_tensors(Path(path) / "model.safetensors", self.model.state_dict())
        meta = {**self.model_config.to_dict(), "model_type": "lmforge-seq2seq"}
        meta["task"] = {"reverse": self.cfg.reverse, "vocab": self.task.vocab}
        write_json(Path(path) / "config.json", meta)

    def data_state(self):
        version, internal, gauss = self.rng.getstate()  # JSON: lists of ints
        return {"version": version, "state": list(internal), "gauss": gauss}

    def load_data_state(self, state) -> None:
        self.rng.setstate((state["version"], tuple(state["state"]), state["gauss"]))

    def signature(self) -> dict:
        return {**self.model_config.to_dict(), "reverse": self.cfg.reverse}

    def finish(self, result: dict) -> dict:
        if self.cfg.beam > 1:
            beam = self.task.translation_accuracy(self.model, self.task.test, beam=self.cfg.beam)
            result["test_exact_beam"] = beam
        return result


def train(cfg: Seq2SeqTrainConfig, log=print, resume: bool = False) -> dict[str, float]:
    """Train, evaluate exact match on held-out numbers, save weights + config + metrics."""
    return Seq2SeqTrainer(cfg, resume=resume, log=log).run()


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
    result = train(cfg, resume=args.resume)
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
