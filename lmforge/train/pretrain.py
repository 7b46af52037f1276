"""Pretraining: tokenizer -> token shards -> next-token training -> checkpoint, samples, plot.

The loop is nanoGPT's: sample random blocks, AdamW with warmup + cosine, clip, evaluate every
`eval_interval` steps. What it adds is what long runs need: an exact resume (model, optimizer,
RNG and data position in one atomic file), Ctrl-C saving, a stop on NaN that keeps the last
good checkpoint, a metrics CSV and a PNG of the curves.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lmforge.data import TokenShard, iterate_eval_batches, prepare_corpus
from lmforge.errors import CheckpointError, ConfigError, LMForgeError, require_device
from lmforge.eval.perplexity import bits_per_byte, target_bytes, token_bytes_table
from lmforge.fileio import remove_stale_temps, write_json
from lmforge.lm import LM
from lmforge.model.transformer import Transformer
from lmforge.tokenizer import Tokenizer
from lmforge.train.checkpoint import (
    STATE_FILE,
    load_training_state,
    model_state,
    rng_state,
    save_training_state,
    set_rng_state,
)
from lmforge.train.config import TrainConfig
from lmforge.train.distributed import NullMetrics, micro_batch_seed, setup_parallel
from lmforge.train.metrics import MetricsLog
from lmforge.train.optim import LossScaler, build_adamw, cosine_lr

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NonFiniteLoss(LMForgeError):
    """The loss became NaN or inf: training stopped, the last good checkpoint is kept."""


def resolve_dtype(name: str, device: torch.device) -> str:
    """`auto` picks the fastest safe autocast dtype: bf16 where the hardware does bf16 matmuls
    natively (CUDA with bf16, CPUs with AMX), fp16 on older GPUs, fp32 otherwise. Any other
    name must be one of DTYPES (ConfigError naming `dtype` if not)."""
    if name != "auto":
        if name not in DTYPES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device.type == "cpu" and torch.cpu._is_amx_tile_supported():
        return "bfloat16"
    return "float32"


def resolve_device(name: str) -> torch.device:
    """The torch device for a run's `device` setting (`auto` = CUDA when available, else CPU).
    An unknown name, or a GPU this machine lacks, is a ConfigError naming the setting."""
    return require_device(name, "device")


def build_tokenizer(cfg: TrainConfig, out_dir: Path) -> Tokenizer:
    """Reuse the run's tokenizer, load a given one, or train one on the corpus."""
    if (out_dir / "tokenizer.json").is_file():
        return Tokenizer.load(out_dir)
    if cfg.tokenizer not in ("bpe", "char", "word"):
        return Tokenizer.load(cfg.tokenizer)
    from lmforge.data import read_documents

    docs = read_documents(cfg.data, text_field=cfg.text_field)
    if cfg.tokenizer == "bpe":
        return Tokenizer.train_bpe(docs, vocab_size=cfg.vocab_size)
    if cfg.tokenizer == "char":
        return Tokenizer.train_char(docs)
    return Tokenizer.train_word(docs, vocab_size=cfg.vocab_size)


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
    was_training = model.training
    model.eval()
    blocks = cfg.eval_iters * cfg.batch_size
    vocab = model.config.vocab_size
    per_pass = min(blocks, max(cfg.batch_size, 64_000_000 // (cfg.block_size * vocab)))
    # sums over the passes (few: each is large) on the host, in float64
    nats, n_bytes, n_targets, count = 0.0, 0, 0, 0
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
    model.train(was_training)
    bpb = bits_per_byte(nats, n_bytes) if token_bytes is not None else math.nan
    return nats / max(1, n_targets), bpb


class Pretrainer:
    """One pretraining run, from a TrainConfig to a checkpoint directory."""

    def __init__(self, cfg: TrainConfig, resume: bool = False, log=print):
        self.cfg, self.log = cfg, log
        self.out_dir = Path(cfg.out_dir)
        # one process, or one rank of a torchrun job (DDP/FSDP2; lmforge/train/distributed.py)
        self.dist = setup_parallel(cfg, resolve_device(cfg.device))
        if not self.dist.is_main:
            self.log = lambda *args, **kwargs: None
        self.device = self.dist.device
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        state_path = self.out_dir / self.dist.state_file
        if resume and not state_path.is_file():
            raise CheckpointError(f"--resume: no training state at {state_path}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # temps of saves killed mid-write (SIGKILL, OOM killer) in an earlier run of this folder
        remove_stale_temps(self.out_dir)
        remove_stale_temps(self.out_dir / "data")

        with self.dist.rank_zero_first():  # the other ranks then reuse rank 0's files
            self.tokenizer = build_tokenizer(cfg, self.out_dir)
            self.tokenizer.save(self.out_dir)
            meta = prepare_corpus(
                cfg.data, self.tokenizer, self.out_dir / "data", val_fraction=cfg.val_fraction,
                text_field=cfg.text_field, progress=cfg.progress, workers=cfg.tokenize_workers,
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
        self.optimizer = build_adamw(self.model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
        self.scaler = LossScaler() if self.dtype == "float16" else None
        self.sampler = self.dist.sampler(
            self.train_shard, cfg.batch_size, cfg.block_size, cfg.grad_accum, cfg.seed
        )
        self.step = 0
        self.tokens_seen = 0
        self.elapsed = 0.0  # training seconds across resumes
        if resume:
            self._load_state(state_path)
        if self.dist.is_main:
            self.metrics = MetricsLog(self.out_dir, cfg.tensorboard, resume=resume)
            write_json(self.out_dir / "train_config.json", cfg.to_dict())
        else:
            self.metrics = NullMetrics()
        self.forward = torch.compile(self.wrapped) if cfg.compile else self.wrapped
        self.log(
            f"data: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens; "
            f"model: {self.model.num_parameters():,} parameters; {self.device}, {self.dtype}"
        )

    def autocast(self):
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=DTYPES[self.dtype])

    # ---- state -------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Model in HF layout for users, full state in one atomic file for --resume (under
        torchrun: a sharded checkpoint, every rank writing its part)."""
        full = self.dist.full_model(self.model)  # None on ranks other than 0
        if full is not None:
            LM(full, self.tokenizer).save(self.out_dir)
        if self.dist.sharded:
            progress = {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed": self.elapsed,
                        "scaler": self.scaler.state_dict() if self.scaler else None,
                        "model_config": self.model_config.to_dict()}  # fmt: skip
            self.dist.save_state(self.out_dir, self.model, self.optimizer, self.sampler, progress)
            return
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "elapsed": self.elapsed,
            "model": model_state(self.model),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "model_config": self.model_config.to_dict(),
        }
        save_training_state(self.out_dir / STATE_FILE, state)

    def _load_state(self, path: Path) -> None:
        if self.dist.sharded:
            state = self.dist.load_state(
                path, self.model, self.optimizer, self.sampler, self.model_config.to_dict()
            )
        else:
            state = load_training_state(path)
            if state["model_config"] != self.model_config.to_dict():
                raise CheckpointError(
                    f"{path}: saved with a different model config; start a new out_dir or "
                    "restore the original settings"
                )
            self.model.load_state_dict(state["model"], strict=False)
            self.optimizer.load_state_dict(state["optimizer"])
            try:
                self.sampler.load_state_dict(state["sampler"])
            except LMForgeError as err:
                raise CheckpointError(f"{path}: {err}") from err
            set_rng_state(state["rng"])
        if self.scaler and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        self.elapsed = state["elapsed"]
        self.log(f"resumed from step {self.step}")

    # ---- the loop ----------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step on the global batch (grad_accum lanes of batch_size blocks, this
        rank running its share); returns the global batch's mean loss, the same on every rank
        and under any launch (one process or torchrun with any world size)."""
        cfg = self.cfg
        lr = cosine_lr(self.step, cfg.lr, cfg.min_lr, cfg.warmup_iters, cfg.lr_decay_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=self.device)
        accum = self.dist.accumulation_steps(cfg.grad_accum)  # this rank's share of the batch
        for i in range(accum):
            x, y = self.sampler.next_batch()
            # this lane's dropout masks, whichever rank runs it after however many others
            torch.manual_seed(micro_batch_seed(cfg.seed, self.step, self.sampler.lanes[i]))
            with self.dist.no_sync(last=i == accum - 1):  # reduce gradients once per step
                with self.autocast():
                    loss = lm_loss(self.forward(x), y, cfg.label_smoothing)
                    aux = self.model.aux_loss()  # MoE load balancing (λ·L_aux); None when dense
                    loss = (loss if aux is None else loss + aux) / accum
                if self.scaler:
                    (loss * self.scaler.scale).backward()
                else:
                    loss.backward()
            total += loss.detach().float()  # one host sync per step, not per micro-batch
        # every micro-batch holds batch_size x block_size targets, so the mean of the ranks'
        # means of their micro-batch means is the mean over the global batch
        total = self.dist.mean(total.item())
        # checked BEFORE the update: a NaN step must not reach the weights or AdamW's moments
        if not math.isfinite(total):
            raise NonFiniteLoss(
                f"loss became {total} at step {self.step}; stopped. The last good checkpoint "
                f"in {self.out_dir} is kept (lower lr, or use bfloat16 instead of float16)."
            )
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler is None or self.scaler.unscale_and_check(params):
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.tokens_seen += cfg.batch_size * cfg.block_size * cfg.grad_accum
        return total

    def run(self) -> dict[str, float]:
        """Train to max_iters (or max_time), then save, sample and plot. Returns final metrics."""
        cfg = self.cfg
        self.model.train()
        bar = None
        if cfg.progress and self.dist.is_main:
            from tqdm import tqdm

            bar = tqdm(total=cfg.max_iters, initial=self.step, unit="it", dynamic_ncols=True)
        result: dict[str, float] = {}
        window_tokens, window_start = 0, time.perf_counter()
        try:
            while self.step < cfg.max_iters:
                t0 = time.perf_counter()
                loss = self.train_step()
                self.elapsed += time.perf_counter() - t0
                window_tokens += cfg.batch_size * cfg.block_size * cfg.grad_accum
                if bar is not None:
                    bar.update(1)
                if self.step % cfg.log_interval == 0 or self.step == 1:
                    tps = window_tokens / max(1e-9, time.perf_counter() - window_start)
                    window_tokens, window_start = 0, time.perf_counter()
                    lr = self.optimizer.param_groups[0]["lr"]
                    self.metrics.log(self.step, "train", loss=loss, lr=lr, tokens_per_s=tps)
                    if bar is not None:
                        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tps:,.0f}")
                out_of_time = cfg.max_time is not None and self.elapsed >= cfg.max_time
                last = self.step >= cfg.max_iters or out_of_time
                if self.step % cfg.eval_interval == 0 or last:
                    result = self._evaluate()
                    if bar is not None:
                        bar.write(self._eval_line(result))
                if self.step % cfg.checkpoint_interval == 0 or last:
                    self.save_checkpoint()
                if out_of_time:
                    break
        except KeyboardInterrupt:
            self.save_checkpoint()
            self.log(f"\ninterrupted: checkpoint saved at step {self.step}; continue with --resume")
            raise
        finally:
            if bar is not None:
                bar.close()
            self.metrics.close()
        plot = self.metrics.plot(
            [("train", "loss"), ("val", "loss"), ("train", "lr")],
            self.out_dir / "loss.png", title=f"pretraining {self.out_dir.name}",
        )  # fmt: skip
        result.update(
            step=self.step, elapsed_s=self.elapsed, tokens_per_s=self.tokens_seen / self.elapsed
        )
        if self.dist.is_main:
            write_json(self.out_dir / "final_metrics.json", result)
        result["plot"] = str(plot)
        return result

    def _eval_line(self, r: dict[str, float]) -> str:
        return (
            f"step {self.step}: train {r['train_loss']:.4f}, val {r['val_loss']:.4f}, "
            f"val ppl {r['val_ppl']:.2f}, val bpb {r['val_bpb']:.4f}"
        )

    def _evaluate(self) -> dict[str, float]:
        t0 = time.perf_counter()
        args = (self.cfg, self.device, self.autocast, self.token_bytes)
        train, _ = evaluate(self.model, self.train_shard, *args)
        val, bpb = evaluate(self.model, self.val_shard, *args)
        self.elapsed += time.perf_counter() - t0
        ppl = math.exp(min(val, 50.0))
        self.metrics.log(self.step, "val", loss=val, ppl=ppl, bpb=bpb)
        self.metrics.log(self.step, "train_eval", loss=train)
        return {"train_loss": train, "val_loss": val, "val_ppl": ppl, "val_bpb": bpb}

    def samples(self, n: int | None = None, max_new_tokens: int | None = None) -> list[str]:
        """A few text samples from the current model (temperature 0.8, top-k 200 like nanoGPT)."""
        n = self.cfg.samples if n is None else n
        if n < 1:
            return []
        model = self.dist.full_model(self.model)  # under torchrun: rank 0 samples, others []
        if model is None:
            return []
        lm = LM(model, self.tokenizer)
        tokens = min(max_new_tokens or self.cfg.sample_tokens, self.model_config.max_seq_len - 1)
        return lm.complete(
            [self.cfg.sample_prompt] * n, max_new_tokens=tokens, temperature=0.8, top_k=200,
            seed=self.cfg.seed,
        )  # fmt: skip
