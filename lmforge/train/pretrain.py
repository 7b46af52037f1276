"""Pretraining: tokenizer -> token shards -> next-token training -> checkpoint, samples, plot.

The recipe is nanoGPT's: sample random blocks, AdamW with warmup + cosine, clip, evaluate every
`eval_interval` steps. The loop (lmforge/train/loop.py) adds what long runs need: an exact
resume (model, optimizer, RNG and data position in one atomic file), Ctrl-C / SIGTERM saving, a
stop on NaN that keeps the last good checkpoint, a metrics CSV and a PNG of the curves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from lmforge.data import TokenShard, iterate_eval_batches, prepare_corpus
from lmforge.errors import ConfigError, require_device
from lmforge.fileio import remove_stale_temps
from lmforge.lm import LM
from lmforge.model.info import flops_per_token, peak_bf16_tflops
from lmforge.model.modes import eval_mode
from lmforge.model.transformer import Transformer
from lmforge.tokenizer import Tokenizer
from lmforge.tokenizer.byte_counts import bits_per_byte, target_bytes, token_bytes_table
from lmforge.train.config import TrainConfig
from lmforge.train.loop import Trainer, training_dtype
from lmforge.train.parallel import setup_parallel
from lmforge.train.samplers import LaneSampler, micro_batch_seed
from lmforge.train.whole_copy import TrainerWrapsModel

TOKENIZER_KINDS = ("bpe", "char", "word")


def train_tokenizer(kind: str, texts, vocab_size: int, special_tokens=None, **bpe) -> Tokenizer:
    """A tokenizer of `kind` (TOKENIZER_KINDS) trained on `texts`; `bpe` are train_bpe's own
    options (min_frequency, show_progress). A char tokenizer ignores vocab_size."""
    if kind == "bpe":
        return Tokenizer.train_bpe(texts, vocab_size, special_tokens, **bpe)
    if kind == "char":
        return Tokenizer.train_char(texts, special_tokens)
    if kind == "word":
        return Tokenizer.train_word(texts, vocab_size, special_tokens)
    raise ConfigError(f"tokenizer must be {', '.join(TOKENIZER_KINDS)} or a path; got {kind!r}")


def build_tokenizer(cfg, out_dir: Path, train: Callable[[], Tokenizer] | None = None) -> Tokenizer:
    """The run's tokenizer: the one saved in out_dir (a resumed or repeated run), the one at
    cfg.tokenizer when that is a path, else `train()` or one of that kind trained on cfg.data."""
    if (out_dir / "tokenizer.json").is_file():
        return Tokenizer.load(out_dir)
    if cfg.tokenizer not in TOKENIZER_KINDS:
        return Tokenizer.load(cfg.tokenizer)
    if train is not None:
        return train()
    from lmforge.data import read_documents

    docs = read_documents(cfg.data, text_field=cfg.text_field)
    return train_tokenizer(cfg.tokenizer, docs, cfg.vocab_size)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0):
    """Mean next-token cross-entropy (targets already shifted; -100 positions ignored)."""
    return F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), targets.view(-1),
        ignore_index=-100, label_smoothing=label_smoothing,
    )  # fmt: skip


@torch.inference_mode()
def evaluate(
    model, shard: TokenShard, cfg: TrainConfig, device, autocast,
    token_bytes: torch.Tensor | None = None,
) -> tuple[float, float]:  # fmt: skip
    """(mean loss, bits per byte) over the first eval_iters x batch_size sequential blocks of a
    split. Bits per byte divides the summed loss by the UTF-8 bytes of exactly the target tokens
    scored (`token_bytes`: the tokenizer's per-id byte lengths, `token_bytes_table`); without
    it, it is NaN.

    The blocks are deterministic, and scored in as few forward passes as memory allows
    (logits capped at ~64M floats): the same tokens as eval_iters training-sized batches,
    with less per-call overhead.
    """
    blocks = cfg.eval_iters * cfg.batch_size
    vocab = model.config.vocab_size
    per_pass = min(blocks, max(cfg.batch_size, 64_000_000 // (cfg.block_size * vocab)))
    # sums over the passes (few: each is large) on the host, in float64
    nats, n_bytes, n_targets, count = 0.0, 0, 0, 0
    with eval_mode(model):
        for x, y in iterate_eval_batches(shard, per_pass, cfg.block_size):
            x, y = x[: blocks - count].to(device), y[: blocks - count].to(device)
            with autocast():
                logits = model(x)
            nats += F.cross_entropy(
                logits.float().view(-1, logits.size(-1)), y.reshape(-1), reduction="sum"
            ).item()  # ignore_index=-100, as in training: those positions are not scored
            n_targets += int((y != -100).sum())
            if token_bytes is not None:
                n_bytes += int(target_bytes(y, token_bytes))
            count += len(x)
            if count >= blocks:
                break
    bpb = bits_per_byte(nats, n_bytes) if token_bytes is not None else math.nan
    return nats / max(1, n_targets), bpb


def device_peak_tflops(cfg: TrainConfig, device: torch.device) -> float | None:
    """The peak TFLOPS MFU is reported against: cfg.peak_tflops when given, else the bf16 peak
    of a known CUDA GPU (`peak_bf16_tflops`), else None (no MFU: a CPU's peak depends on its
    cores, clocks and SIMD units, which torch does not report)."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops
    if device.type == "cuda":
        return peak_bf16_tflops(torch.cuda.get_device_name(device))
    return None


class Pretrainer(Trainer):
    """One pretraining run, from a TrainConfig to a checkpoint directory."""

    name = "pretraining"
    curves = [("train", "loss"), ("val", "loss"), ("train", "lr")]
    plot_file = "loss.png"

    def __init__(self, cfg: TrainConfig, resume: bool = False, log=print):
        self.began = time.perf_counter()  # milestone times count from here: setup included
        self.milestones: dict[str, dict[str, float]] = {}  # "1.89" -> step, seconds, val loss
        # one process, or one rank of a torchrun job (DDP/FSDP2; lmforge/train/parallel.py)
        dist = setup_parallel(cfg, require_device(cfg.device))
        self.open_run(cfg, dist, resume, log, wrapping=TrainerWrapsModel())
        self.dtype = training_dtype(cfg.dtype, self.device)
        remove_stale_temps(self.out_dir / "data")
        with self.dist.rank_zero_first():  # the other ranks then reuse rank 0's files
            self.tokenizer = build_tokenizer(cfg, self.out_dir)
            self.tokenizer.save(self.out_dir)
            meta = prepare_corpus(
                cfg.data, self.tokenizer, self.out_dir / "data", val_fraction=cfg.val_fraction,
                text_field=cfg.text_field, progress=cfg.optim.progress,
                workers=cfg.tokenize_workers,
            )  # fmt: skip
        self.train_shard = TokenShard.open(self.out_dir / "data" / "train.bin")
        self.val_shard = TokenShard.open(self.out_dir / "data" / "val.bin")
        self.model_config = cfg.model_config(self.tokenizer.vocab_size)
        # UTF-8 bytes per token id, for validation bits per byte (comparable across tokenizers)
        self.token_bytes = token_bytes_table(self.tokenizer, self.device)
        # seeded right before init, so every rank (and a plain run) builds the same weights
        # whatever the tokenizer/corpus step did with the RNG on it (FSDP2 shards each rank's
        # own copy; it does not broadcast rank 0's)
        torch.manual_seed(cfg.seed)
        self.model = Transformer(self.model_config).to(self.device)
        self.wrapped = self.dist.wrap(self.model)  # DDP / FSDP2 (sharded in place) / itself
        # this rank's data lanes [rank*k, (rank+1)*k): all of them on a single process, so every
        # launch draws the same global batch (lmforge/train/parallel.py)
        k = cfg.optim.grad_accum // self.dist.world_size
        lanes = range(self.dist.rank * k, (self.dist.rank + 1) * k)
        self.sampler = LaneSampler(
            self.train_shard, cfg.batch_size, cfg.block_size, cfg.seed, lanes, self.device
        )
        self.tokens_per_step = cfg.batch_size * cfg.block_size * cfg.optim.grad_accum
        flops = flops_per_token(self.model_config, cfg.block_size)["training"]
        self.flops_per_token, self.peak_tflops = flops, device_peak_tflops(cfg, self.device)
        self.start(self.model)
        self.forward = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        peak = f", MFU against {self.peak_tflops:g} TFLOPS" if self.peak_tflops else ""
        self.log(
            f"data: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens; "
            f"model: {self.model.num_parameters():,} parameters, {flops / 1e9:.3g} GFLOPs per "
            f"trained token; {self.device}, {self.dtype}{peak}"
        )

    # ---- what the loop asks for --------------------------------------------------------------
    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """This rank's share of the global batch: one (x, y, lane) per data lane it draws."""
        return [(*self.sampler.next_batch(), lane) for lane in self.sampler.lanes]

    def micro_batches(self, batch: list) -> list:
        return batch  # already one micro-batch per lane

    def loss_weight(self, batch) -> float:
        return float(self.cfg.batch_size)  # every micro-batch is batch_size full blocks

    def loss(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        x, y, lane = batch
        # this lane's dropout masks, whichever rank runs it after however many others
        torch.manual_seed(micro_batch_seed(self.cfg.seed, self.step, lane))
        loss = lm_loss(self.forward(x), y, self.cfg.label_smoothing)
        aux = self.model.aux_loss()  # MoE load balancing (λ·L_aux); None when dense
        return (loss if aux is None else loss + aux), {}

    def should_stop(self, evaluated: dict[str, float]) -> bool:
        return self.cfg.target_loss is not None and evaluated["val_loss"] <= self.cfg.target_loss

    def out_of_time(self) -> bool:
        return self.cfg.max_time is not None and self.elapsed >= self.cfg.max_time

    def export(self, path: Path) -> None:
        """The model in HF layout (under torchrun a collective: FSDP gathers the shards)."""
        full = self.dist.full_model(self.model)  # None on ranks other than 0
        if full is not None:
            LM(full, self.tokenizer).save(path)

    def evaluate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        args = (self.cfg, self.device, self.autocast, self.token_bytes)
        train, _ = evaluate(self.model, self.train_shard, *args)
        val, bpb = evaluate(self.model, self.val_shard, *args)
        self.elapsed += time.perf_counter() - t0
        ppl = math.exp(min(val, 50.0))
        return {"train_loss": train, "val_loss": val, "val_ppl": ppl, "val_bpb": bpb}

    def log_evaluation(self, r: dict[str, float]) -> None:
        self.metrics.log(self.step, "val", loss=r["val_loss"], ppl=r["val_ppl"], bpb=r["val_bpb"])
        self.metrics.log(self.step, "train_eval", loss=r["train_loss"])
        seconds = time.perf_counter() - self.began
        for m in self.cfg.loss_milestones:
            if r["val_loss"] <= m and f"{m:g}" not in self.milestones:
                self.milestones[f"{m:g}"] = {"step": self.step, "seconds": seconds,
                                             "val_loss": r["val_loss"]}  # fmt: skip

    def eval_line(self, r: dict[str, float]) -> str:
        reached = [f"{k} at {v['seconds']:.1f} s" for k, v in self.milestones.items()
                   if v["step"] == self.step]  # fmt: skip
        return (
            f"step {self.step}: train {r['train_loss']:.4f}, val {r['val_loss']:.4f}, "
            f"val ppl {r['val_ppl']:.2f}, val bpb {r['val_bpb']:.4f}"
            + (f"; val loss reached {', '.join(reached)}" if reached else "")
        )

    def extra_state(self) -> dict:
        return {"milestones": self.milestones}

    def load_extra_state(self, state: dict) -> None:
        self.milestones = dict(state.get("milestones", {}))

    def finish(self, result: dict) -> dict:
        """The milestones reached (val loss -> step, seconds since the run began) go in the
        run's final_metrics.json, with the peak GPU memory allocated on CUDA."""
        if self.device.type == "cuda":
            result["cuda_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return {**result, "milestones": self.milestones}

    def samples(self, n: int | None = None, max_new_tokens: int | None = None) -> list[str]:
        """A few text samples from the current model (temperature 0.8, top-k 200 like nanoGPT)."""
        n = self.cfg.samples if n is None else n
        if n < 1:
            return []
        model = self.dist.full_model(self.model)  # under torchrun: rank 0 samples, others []
        if model is None:
            return []
        tokens = min(max_new_tokens or self.cfg.sample_tokens, self.model_config.max_seq_len - 1)
        return LM(model, self.tokenizer).complete(
            [self.cfg.sample_prompt] * n, max_new_tokens=tokens, temperature=0.8, top_k=200,
            seed=self.cfg.seed,
        )  # fmt: skip
