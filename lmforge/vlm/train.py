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

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import ConfigError
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer
from lmforge.vlm.data import ShapesDataset
from lmforge.vlm.hf_vision import load_hf_vision_tower
from lmforge.vlm.model import IGNORE, VisionLanguageModel, build_tokenizer
from lmforge.vlm.vision import VisionConfig, VisionEncoder


def _default_model() -> dict[str, Any]:
    return {"n_layer": 2, "n_head": 4, "d_model": 128, "pos": "rope", "norm": "rmsnorm",
            "mlp": "swiglu", "bias": False}  # fmt: skip


@dataclass
class VLMTrainConfig:
    """A run on ShapesDataset. `model` holds ModelConfig fields of the language model."""

    out_dir: str = "out/vlm-shapes"
    seed: int = 0
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
    model: dict[str, Any] = field(default_factory=_default_model)
    steps: int = 1500
    # CPU seconds of training steps (process time, evaluation excluded); stop when reached. CPU
    # time, not wall time: on a shared machine the wall time depends on the other users.
    max_time: float | None = None
    batch_size: int = 32
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup: int = 50
    weight_decay: float = 0.01
    text_dropout: float = 0.0  # caption input tokens replaced by UNK (targets kept): word dropout
    grad_clip: float = 1.0
    eval_interval: int = 250  # validation every N steps; the best step is kept
    eval_size: int = 500  # images per split (validation at each evaluation; test, novel at the end)
    report: bool = True  # score test and novel once at the end (a selection sweep turns it off)
    log_interval: int = 10
    threads: int | None = None  # torch threads (None: leave torch's default)
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_interval", "eval_size", "log_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.text_dropout < 1:
            raise ConfigError(f"text_dropout must be in [0, 1), got {self.text_dropout}")
        if self.lr <= 0 or self.min_lr < 0:
            raise ConfigError(f"lr must be > 0 and min_lr >= 0, got {self.lr}, {self.min_lr}")

    def vision_config(self) -> VisionConfig:
        return VisionConfig(
            image_size=self.image_size, patch_size=self.patch_size, d_model=self.vision_dim,
            n_layer=self.vision_layers, n_head=self.vision_heads, use_cls=self.use_cls,
            patch_embed=self.patch_embed,
        )  # fmt: skip

    def text_config(self, vocab_size: int, seq_len: int) -> ModelConfig:
        overrides = {"vocab_size": vocab_size, "max_seq_len": seq_len, **self.model}
        return ModelConfig.from_dict(overrides, source="model")


def build_data(cfg: VLMTrainConfig) -> ShapesDataset:
    return ShapesDataset(cfg.image_size, cfg.seed, cfg.max_count, cfg.min_shape, cfg.max_shape,
                         cfg.colours, cfg.shapes)  # fmt: skip


def build_model(cfg: VLMTrainConfig, data: ShapesDataset) -> VisionLanguageModel:
    """A fresh model sized for the shapes captions (vocabulary and sequence length)."""
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer(data.vocabulary_texts(), cfg.tokenizer)
    tower = pretrained_tower(cfg) if cfg.vision_tower else VisionEncoder(cfg.vision_config())
    vision = tower.config
    longest = "three yellow triangles left of three yellow triangles"
    seq_len = 1 + vision.num_tokens + 2 + len(tokenizer.encode(longest)) + 1
    text = cfg.text_config(tokenizer.vocab_size, seq_len + 8)  # a little room for prompts
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
def exact_match(
    vlm: VisionLanguageModel, data: ShapesDataset, split: str, n: int, batch: int = 100
) -> float:
    """Fraction of the first n images of `split` whose greedy caption equals the reference."""
    correct = 0
    for lo in range(0, n, batch):
        pixels, refs = data.batch(split, range(lo, min(n, lo + batch)))
        correct += sum(c == r for c, r in zip(vlm.caption(pixels, temperature=0.0), refs))
    return correct / n


@torch.no_grad()
def caption_loss(
    vlm: VisionLanguageModel, data: ShapesDataset, split: str, n: int, batch: int = 100
) -> float:
    """Mean next-token cross entropy of the reference captions of the first n images of `split`
    (teacher forcing; eval mode), weighted by caption tokens."""
    was_training = vlm.training
    vlm.eval()
    total = tokens = 0.0
    try:
        for lo in range(0, n, batch):
            pixels, captions = data.batch(split, range(lo, min(n, lo + batch)))
            ids, labels = vlm.collate([vlm.encode_example(c) for c in captions])
            count = int((labels[:, 1:] != IGNORE).sum())
            total += vlm.loss(ids, labels, pixels).item() * count
            tokens += count
    finally:
        vlm.train(was_training)
    return total / tokens


def evaluate(vlm: VisionLanguageModel, data: ShapesDataset, split: str, n: int) -> dict[str, float]:
    """{split}_exact and {split}_loss on the first n images of `split`."""
    return {f"{split}_exact": exact_match(vlm, data, split, n),
            f"{split}_loss": caption_loss(vlm, data, split, n)}  # fmt: skip


def train(cfg: VLMTrainConfig, log=print) -> dict[str, Any]:
    """Train, keep the step with the best validation score, save its checkpoint + metrics.csv +
    loss.png in out_dir; return the validation scores (and test / novel when cfg.report)."""
    from tqdm import tqdm

    from lmforge.fileio import remove_stale_temps, write_json
    from lmforge.train.metrics import MetricsLog
    from lmforge.train.optim import build_adamw, cosine_lr

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    data = build_data(cfg)
    vlm = build_model(cfg, data)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = build_adamw(vlm, cfg.lr, cfg.weight_decay, (0.9, 0.99))
    remove_stale_temps(out)  # temps of saves killed mid-write in an earlier run
    metrics = MetricsLog(out)
    best: dict[str, Any] = {}
    start, train_time, train_cpu, step = time.perf_counter(), 0.0, 0.0, 0
    cpu_start = time.process_time()  # CPU seconds too: wall time on a shared machine is noisy
    bar = tqdm(range(1, cfg.steps + 1), disable=not cfg.progress, unit="step")
    for step in bar:
        t0, c0 = time.perf_counter(), time.process_time()
        lr = cosine_lr(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        first = (step - 1) * cfg.batch_size
        pixels, captions = data.batch("train", range(first, first + cfg.batch_size))
        ids, labels = vlm.collate([vlm.encode_example(c) for c in captions])
        if cfg.text_dropout > 0:  # the model must read more from the image than from the text
            drop = (labels != IGNORE) & (torch.rand(ids.shape, generator=gen) < cfg.text_dropout)
            ids = ids.masked_fill(drop, vlm.tokenizer.unk_id)
        vlm.train()
        loss = vlm.loss(ids, labels, pixels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vlm.parameters(), cfg.grad_clip)
        opt.step()
        train_time += time.perf_counter() - t0
        train_cpu += time.process_time() - c0
        if not math.isfinite(loss.item()):
            raise ConfigError(f"loss became {loss.item()} at step {step}; lower lr")
        if step % cfg.log_interval == 0:
            metrics.log(step, "train", loss=loss.item(), lr=lr)
            bar.set_postfix(loss=f"{loss.item():.4f}")
        out_of_time = cfg.max_time is not None and train_cpu >= cfg.max_time
        if step % cfg.eval_interval == 0 or step == cfg.steps or out_of_time:
            scores = evaluate(vlm, data, "validation", cfg.eval_size)
            metrics.log(step, "eval", **scores)
            key = (scores["validation_exact"], -scores["validation_loss"])
            if not best or key > best["key"]:  # higher exact match, then lower loss
                best = {"key": key, "step": step, "scores": scores,
                        "state": copy.deepcopy(vlm.state_dict())}  # fmt: skip
                vlm.save(out)
            log(
                f"step {step}: loss {loss.item():.4f}  validation exact match "
                f"{scores['validation_exact']:.1%} (loss {scores['validation_loss']:.4f}); "
                f"best step {best['step']}"
            )
        if out_of_time:
            break
    bar.close()
    vlm.load_state_dict(best["state"])  # the validation-best step is the model
    result: dict[str, Any] = {**best["scores"], "best_step": best["step"]}
    if cfg.report:  # read once, to report: nothing is chosen on these
        for split in ("test", "novel"):
            result[f"{split}_exact"] = exact_match(vlm, data, split, cfg.eval_size)
    result.update(steps=step, train_s=train_time, train_cpu_s=train_cpu,
                  total_s=time.perf_counter() - start,
                  cpu_s=time.process_time() - cpu_start)  # fmt: skip
    write_json(out / "train_config.json", asdict(cfg))
    write_json(out / "final_metrics.json", result)
    curves = [("train", "loss"), ("eval", "validation_loss"), ("eval", "validation_exact")]
    result["plot"] = str(metrics.plot(curves, out / "loss.png", title="vlm shapes"))
    metrics.close()
    return result
