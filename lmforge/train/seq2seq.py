"""Training the encoder-decoder (lmforge.model.seq2seq) on the built-in number task, and loading
the result (`lmforge seq2seq`)."""

from __future__ import annotations

import random
from dataclasses import field
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import ConfigError, require_positive_ints
from lmforge.fileio import load_tensors, read_json, save_tensors, write_json
from lmforge.model.seq2seq import NumberTask, Seq2Seq, Seq2SeqConfig
from lmforge.train.config import SmallRunConfig, require_fraction, run_config
from lmforge.train.loop import Trainer
from lmforge.train.parallel import Parallel


@run_config(optim=dict(max_iters=1500, lr=2e-3, warmup_iters=50))
class Seq2SeqTrainConfig(SmallRunConfig):
    """A run on NumberTask. `model` holds Seq2SeqConfig fields (vocab comes from the task)."""

    out_dir: str = "out/seq2seq"
    reverse: bool = False  # False: words -> digits; True: digits -> words
    max_number: int = 10000
    test_fraction: float = 0.1
    batch_size: int = 64
    beam: int = 4  # beam width for the final evaluation (1 = greedy only)
    threads: int | None = 1
    model: dict[str, Any] = field(default_factory=lambda: {"d_model": 64, "d_ff": 256, "n_head": 4})

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_ints(self, "max_number", "beam")
        require_fraction(self, "test_fraction")


class Seq2SeqTrainer(Trainer):
    """Trains the encoder-decoder on random batches of the task's training numbers; exact match
    on held-out numbers every eval_interval steps, with beam search at the end."""

    name = "seq2seq"
    curves = [("train", "loss"), ("eval", "test_exact")]
    plot_file = "loss.png"

    def __init__(self, cfg: Seq2SeqTrainConfig, resume: bool = False, log=print):
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

    def loss(self, batch):
        return self.model.loss(*batch), {}

    def evaluate(self) -> dict[str, float]:
        score = self.task.translation_accuracy
        return {"train_exact": score(self.model, self.dev),
                "test_exact": score(self.model, self.task.test)}  # fmt: skip

    def eval_line(self, result: dict[str, float]) -> str:
        return f"step {self.step}: held-out exact match {result['test_exact']:.2%}"

    def export(self, path: Path) -> None:
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


def load(checkpoint: str):
    """(model, task) from a directory written by Seq2SeqTrainer."""
    meta = read_json(Path(checkpoint) / "config.json", "seq2seq config")
    task_meta = meta.pop("task")
    meta.pop("model_type", None)
    model = Seq2Seq(Seq2SeqConfig(**meta))
    model.load_state_dict(load_tensors(Path(checkpoint) / "model.safetensors"))
    return model.eval(), NumberTask(reverse=task_meta["reverse"])
