"""Training a VisionLanguageModel on the built-in synthetic shapes captions, and scoring it.

Every step draws fresh images (sample indices step*B .. step*B+B-1 of the "train" split), so the
model never sees an image twice. Every eval_interval steps the model captions the "validation"
images (greedy, KV cache; exact match of the whole caption, ties broken by validation loss) and
the best step so far is kept and saved: the number of steps is a validation choice too. At the
end the best step's weights are restored and, unless `report` is off, scored once on held-out
images of seen pairs ("test") and on held-out colour x shape pairs ("novel"). test and novel are
never used to choose anything; benchmarks/bench_vlm_shapes.py chooses stem, layers and lr on
validation the same way.
"""

from __future__ import annotations

import time
from dataclasses import field
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import ConfigError, require_positive_ints
from lmforge.model.config import ModelConfig
from lmforge.model.modes import eval_mode
from lmforge.model.transformer import Transformer
from lmforge.train.config import SmallRunConfig, run_config
from lmforge.train.loop import Trainer
from lmforge.train.parallel import Parallel
from lmforge.vlm.data import ShapesDataset
from lmforge.vlm.hf_vision import load_hf_vision_tower
from lmforge.vlm.model import IGNORE, VisionLanguageModel, build_vlm_tokenizer
from lmforge.vlm.vision import VisionConfig, VisionEncoder


@run_config(optim=dict(max_iters=1500, lr=2e-3, warmup_iters=50, beta2=0.99, eval_interval=250))
class VLMTrainConfig(SmallRunConfig):
    """A run on ShapesDataset. `model` holds ModelConfig fields of the language model."""

    out_dir: str = "out/vlm-shapes"
    image_size: int = 32
    max_count: int = 3  # shapes per group: 1..max_count
    colours: int = 8  # the first n colours of data.COLOURS
    shapes: int = 5  # the first n shapes of data.SHAPES; held out: data.latin_square_pairs
    min_shape: int = 6  # shape sizes in pixels, drawn per shape at random pixel positions
    max_shape: int = 10
    patch_size: int = 8  # vision patches; the shapes ignore this grid and straddle it
    vision_dim: int = 96
    vision_layers: int = 2  # ViT blocks (lmforge's Block, bidirectional)
    vision_heads: int = 4
    use_cls: bool = False
    # linear (ViT) | conv (convolutional stem) | factorised / late_colour (only for flat-coloured
    # synthetic shapes; see vision.py)
    patch_embed: str = "linear"
    freeze_vision: bool = False
    # HF directory of a CLIP/SigLIP vision model to use as the tower instead of a fresh ViT (its
    # image and patch size must equal image_size and patch_size); vision_* fields are then unused.
    vision_tower: str | None = None
    projector: str = "linear"  # linear | mlp2
    tokenizer: str = "whitespace"  # whitespace | word | char
    model: dict[str, Any] = field(
        default_factory=lambda: {"n_layer": 2, "n_head": 4, "d_model": 128, "pos": "rope",
                                 "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
    )  # fmt: skip
    # CPU seconds of training steps (process time, evaluation excluded); stop when reached. CPU
    # time, not wall time: on a shared machine the wall time depends on the other users.
    max_time: float | None = None
    text_dropout: float = 0.0  # caption input tokens replaced by UNK (targets kept): word dropout
    eval_size: int = 500  # images per split (validation at each evaluation; test, novel at the end)
    report: bool = True  # score test and novel once at the end (a selection sweep turns it off)

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive_ints(self, "eval_size")
        if not 0 <= self.text_dropout < 1:
            raise ConfigError(f"text_dropout must be in [0, 1), got {self.text_dropout}")

    def vision_config(self) -> VisionConfig:
        return VisionConfig(
            image_size=self.image_size, patch_size=self.patch_size, d_model=self.vision_dim,
            n_layer=self.vision_layers, n_head=self.vision_heads, use_cls=self.use_cls,
            patch_embed=self.patch_embed,
        )  # fmt: skip


def build_data(cfg: VLMTrainConfig) -> ShapesDataset:
    return ShapesDataset(cfg.image_size, cfg.seed, cfg.max_count, cfg.min_shape, cfg.max_shape,
                         cfg.colours, cfg.shapes)  # fmt: skip


def build_vlm(cfg: VLMTrainConfig, data: ShapesDataset) -> VisionLanguageModel:
    """A fresh model sized for the shapes captions (vocabulary and sequence length)."""
    torch.manual_seed(cfg.seed)
    tokenizer = build_vlm_tokenizer(data.vocabulary_texts(), cfg.tokenizer)
    tower = pretrained_tower(cfg) if cfg.vision_tower else VisionEncoder(cfg.vision_config())
    longest = "three yellow triangles left of three yellow triangles"
    seq_len = 1 + tower.config.num_tokens + 2 + len(tokenizer.encode(longest)) + 1
    sizes = {"vocab_size": tokenizer.vocab_size, "max_seq_len": seq_len + 8}  # room for prompts
    text = ModelConfig.from_dict({**sizes, **cfg.model}, source="model")
    return VisionLanguageModel(
        Transformer(text), tower, tokenizer, cfg.projector, cfg.freeze_vision
    )


def pretrained_tower(cfg: VLMTrainConfig) -> VisionEncoder:
    tower = load_hf_vision_tower(cfg.vision_tower)
    got = (tower.config.image_size, tower.config.patch_size)
    if got != (cfg.image_size, cfg.patch_size):
        raise ConfigError(
            f"vision_tower {cfg.vision_tower}: image_size/patch_size {got} differ from the "
            f"config's ({cfg.image_size}, {cfg.patch_size}); set them to match"
        )
    return tower


@torch.no_grad()
def caption_scores(
    vlm: VisionLanguageModel, data: ShapesDataset, split: str, n: int, batch: int = 100
) -> dict[str, float]:
    """On the first n images of `split`: {split}_exact, the fraction whose greedy caption equals
    the reference, and {split}_loss, the mean next-token cross entropy of the reference captions
    (teacher forcing; eval mode), weighted by caption tokens."""
    correct = total = tokens = 0.0
    with eval_mode(vlm):
        for lo in range(0, n, batch):
            pixels, refs = data.batch(split, range(lo, min(n, lo + batch)))
            correct += sum(c == r for c, r in zip(vlm.caption(pixels, temperature=0.0), refs))
            ids, labels = vlm.collate([vlm.encode_example(c) for c in refs])
            count = int((labels[:, 1:] != IGNORE).sum())
            total += vlm.loss(ids, labels, pixels).item() * count
            tokens += count
    return {f"{split}_exact": correct / n, f"{split}_loss": total / tokens}


class VLMTrainer(Trainer):
    """Trains on fresh shapes images every step and keeps the validation-best step (see the
    module docstring); out_dir's model is that step's."""

    name = "vlm shapes"
    curves = [("train", "loss"), ("eval", "validation_loss"), ("eval", "validation_exact")]
    plot_file = "loss.png"

    def __init__(self, cfg: VLMTrainConfig, resume: bool = False, log=print):
        self.start_time, self.start_cpu = time.perf_counter(), time.process_time()
        self.data = build_data(cfg)
        self.vlm = build_vlm(cfg, self.data)
        self.open_run(cfg, Parallel(torch.device("cpu")), resume, log)
        self.generator = torch.Generator().manual_seed(cfg.seed)  # text dropout
        self.best: dict[str, Any] = {}
        self.start(self.vlm)

    def signature(self) -> dict[str, Any]:
        return {k: v for k, v in self.cfg.to_dict().items() if k not in RUN_LENGTH}

    def next_batch(self):
        cfg, vlm = self.cfg, self.vlm
        first = self.step * cfg.batch_size  # every step draws images no step saw before
        pixels, captions = self.data.batch("train", range(first, first + cfg.batch_size))
        ids, labels = vlm.collate([vlm.encode_example(c) for c in captions])
        if cfg.text_dropout > 0:  # the model must read more from the image than from the text
            draw = torch.rand(ids.shape, generator=self.generator)
            drop = (labels != IGNORE) & (draw < cfg.text_dropout)
            ids = ids.masked_fill(drop, vlm.tokenizer.unk_id)
        return ids, labels, pixels

    def loss(self, batch):
        return self.vlm.loss(*batch), {}

    def out_of_time(self) -> bool:
        return self.cfg.max_time is not None and self.cpu_elapsed >= self.cfg.max_time

    def evaluate(self) -> dict[str, float]:
        """Validation scores; a new best step (higher exact match, then lower loss) is kept."""
        scores = caption_scores(self.vlm, self.data, "validation", self.cfg.eval_size)
        key = [scores["validation_exact"], -scores["validation_loss"]]
        if not self.best or key > self.best["key"]:
            state = {k: v.detach().clone() for k, v in self.vlm.state_dict().items()}
            self.best = {"key": key, "step": self.step, "scores": scores, "state": state}
        return scores

    def eval_line(self, r: dict[str, float]) -> str:
        return (f"step {self.step}: validation exact match {r['validation_exact']:.1%} (loss "
                f"{r['validation_loss']:.4f}); best step {self.best['step']}")  # fmt: skip

    def export(self, path: Path) -> None:
        """The best step's model (the current one before any evaluation)."""
        current = {k: v.detach().clone() for k, v in self.vlm.state_dict().items()}
        self.vlm.load_state_dict(self.best.get("state", current))
        try:
            self.vlm.save(path)
        finally:
            self.vlm.load_state_dict(current)

    def extra_state(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.best = state.get("best") or {}

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        best = self.best
        self.vlm.load_state_dict(best["state"])  # the validation-best step is the model
        result = {**best["scores"], "best_step": best["step"]}
        if self.cfg.report:  # read once, to report: nothing is chosen on these
            for split in ("test", "novel"):
                scores = caption_scores(self.vlm, self.data, split, self.cfg.eval_size)
                result[f"{split}_exact"] = scores[f"{split}_exact"]
        result.update(steps=self.step, train_s=self.elapsed, train_cpu_s=self.cpu_elapsed,
                      total_s=time.perf_counter() - self.start_time,
                      cpu_s=time.process_time() - self.start_cpu)  # fmt: skip
        return result


# fields a resumed run may change: how long it runs, how often it reports, where it writes
RUN_LENGTH = ("out_dir", "max_iters", "max_time", "eval_interval", "log_interval",
              "checkpoint_interval", "progress", "threads", "report", "lr_decay_iters")  # fmt: skip


def train(cfg: VLMTrainConfig, log=print, resume: bool = False) -> dict[str, Any]:
    """Train, keep the step with the best validation score, save its checkpoint + metrics.csv +
    loss.png in out_dir; return the validation scores (and test / novel when cfg.report)."""
    return VLMTrainer(cfg, resume=resume, log=log).run()
