"""The loop every post-training method shares, so SFT, reward modelling, DPO and continual
learning differ only in their loss.

`AlignConfig` holds the common fields (YAML + `--key value` overrides through
`lmforge.train.config.build_config`); each trainer subclasses it with its own. `AlignTrainer`
loads the starting model (`init`: a checkpoint directory, or `scratch` for a random model with a
character tokenizer, used by tests and the CPU demos), builds AdamW over the trainable parameters,
and runs: warmup + cosine lr, gradient clipping, a tqdm bar, metrics.csv, periodic evaluation,
an HF-layout checkpoint (LM.save) and one atomic training-state file for `--resume`, a PNG of the
curves at the end. A subclass provides `setup()`, `loss(batch) -> (loss, metrics)`,
`evaluate() -> metrics` and, where the saved model is not the policy itself, `export(path)`.

Under `torchrun --nproc_per_node N -m lmforge sft ...` the same loop runs data-parallel (DDP,
lmforge/train/distributed.py): `batch_size` stays the GLOBAL batch, every rank draws the same
shuffled indices and takes its 1/N slice, the subclass's `loss` runs inside one DDP module call
(`LossModule`) so gradients are all-reduced during backward, and each rank's loss is scaled by
its share of `loss_weight` (rows, or response tokens for a token-mean loss) so the averaged
gradient is the one-process gradient of the whole batch. Rank 0 alone evaluates, logs, shows
progress and writes checkpoints; the training state is one file any world size can resume from.

With `parallel: fsdp` the trainable module is sharded with FSDP2 instead (each transformer block
its own unit, the rest in the root; frozen copies such as DPO's reference stay whole on every
rank), so parameters, gradients and optimizer state take 1/N of the memory per rank. What needs
whole weights gets them from a collective gather that every rank joins at the same step: rank 0
keeps one unsharded copy of the trainable module (in CPU memory between uses), refreshes it from
the shards, and evaluates and exports with it; the training-state file holds the gathered
parameters and optimizer state, the same file as one process or DDP writes. Trainers that sample
from the policy every step (GRPO) keep such a copy on every rank (lmforge/align/parallel.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.align.parallel import (
    EpochSampler,
    LossModule,
    WholeCopy,
    check_world_size,
    load_optimizer_state,
    whole_optimizer_state,
)
from lmforge.errors import CheckpointError, ConfigError, LMForgeError, require_positive_ints
from lmforge.fileio import remove_stale_temps, write_json
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tasks.synthetic import ALPHABET
from lmforge.train.checkpoint import (
    STATE_FILE,
    load_training_state,
    rng_state,
    save_training_state,
    set_rng_state,
)
from lmforge.train.distributed import (
    PARALLEL,
    NullMetrics,
    init_parallel,
    launched_by_torchrun,
)
from lmforge.train.metrics import MetricsLog
from lmforge.train.optim import build_adamw, cosine_lr


class NonFiniteLoss(LMForgeError):
    """The loss became NaN or inf; the run stopped and the last good checkpoint is kept."""


@dataclass
class AlignConfig:
    """Fields shared by every post-training run."""

    out_dir: str = "out/align"
    init: str = "scratch"  # checkpoint directory, or "scratch" (random model, char tokenizer)
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields for init=scratch
    data: str = "task:add"  # JSONL file or task:NAME[:LEVEL] (built-in, see align/tasks.py)
    eval_data: str | None = None  # None: held-out split of a task:, else a 5% slice of data
    n_train: int = 2000  # examples drawn from a task: source
    n_eval: int = 200
    skip_invalid: bool = False  # skip (and count) bad records instead of stopping
    add_bos: bool = False
    max_len: int = 64
    batch_size: int = 32
    max_iters: int = 300
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 20
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_interval: int = 100
    log_interval: int = 10
    checkpoint_interval: int | None = None  # None = eval_interval
    seed: int = 1337
    device: str = "auto"
    threads: int | None = None  # CPU threads; 1 is fastest for tiny models on a busy machine
    progress: bool = True
    parallel: str = "ddp"  # under torchrun: ddp (full replica per rank) | fsdp (FSDP2 shards)

    def __post_init__(self) -> None:
        if self.checkpoint_interval is None:
            self.checkpoint_interval = self.eval_interval
        require_positive_ints(
            self, "batch_size", "max_iters", "max_len", "eval_interval", "log_interval"
        )
        if self.lr <= 0 or self.min_lr < 0:
            raise ConfigError(f"lr must be > 0 and min_lr >= 0, got {self.lr}, {self.min_lr}")
        if self.parallel not in PARALLEL:
            raise ConfigError(
                f"parallel must be one of {', '.join(PARALLEL)}; got {self.parallel!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_lm(init: str, model: dict[str, Any], max_len: int, seed: int, device) -> LM:
    """The starting model: a checkpoint directory, or a random one with a char tokenizer that
    covers the built-in tasks' alphabet (`scratch`)."""
    if init == "scratch":
        from lmforge.tokenizer import Tokenizer

        tok = Tokenizer.train_char([ALPHABET])
        fields = {"vocab_size": tok.vocab_size, "max_seq_len": max(max_len, 16), **model}
        config = ModelConfig.from_dict(fields, source="model")
        return LM.from_config(config, tokenizer=tok, seed=seed, device=device)
    lm = LM.load(init, device=device)
    if lm.tokenizer is None:
        raise CheckpointError(f"{init}: no tokenizer.json; post-training needs the tokenizer")
    return lm


class AlignTrainer(ABC):
    """The shared loop. Subclasses set `name`, `curves` and implement the hooks below."""

    name = "align"
    curves: list[tuple[str, str]] = [("train", "loss"), ("eval", "loss")]
    # FSDP: a trainer with its own train_step/run declares that loop shard-safe: it computes
    # losses through `sharded_call` and needs whole weights only through `whole_weights`
    fsdp_own_loop = False
    # FSDP: whole copy of the trained module on rank 0 only (evaluation, export), kept in CPU
    # memory between uses; True: on every rank, on the device (samplers use it every step)
    whole_copy_everywhere = False

    def __init__(self, cfg: AlignConfig, resume: bool = False, log=print):
        self.cfg, self.log = cfg, log
        self.out_dir = Path(cfg.out_dir)
        if launched_by_torchrun():  # a batch that does not split is an error before any work
            check_world_size(cfg.batch_size, int(os.environ["WORLD_SIZE"]))
        own_loop = [f for f in ("train_step", "run") if getattr(type(self), f) is not
                    getattr(AlignTrainer, f)]  # fmt: skip
        if cfg.parallel == "fsdp" and own_loop and not self.fsdp_own_loop:
            raise ConfigError(
                f"parallel=fsdp: {self.name} uses the model outside the shared loop (its own "
                f"{' and '.join(own_loop)}: rollouts, regularisers, extra evaluation), where "
                "sharded weights are not whole; run it with parallel: ddp (FSDP2 covers SFT, "
                "DPO, reward models and GRPO)"
            )
        # one process, or one rank of a torchrun job (DDP; lmforge/train/distributed.py)
        self.dist = init_parallel(cfg.parallel, resolve_device(cfg.device))
        self.dist.sync_buffers = False  # RoPE tables, NF4 weights: identical, never trained
        if not self.dist.is_main:
            self.log = lambda *args, **kwargs: None
        self.device = self.dist.device
        state_path = self.out_dir / STATE_FILE
        if resume and not state_path.is_file():
            raise CheckpointError(f"--resume: no training state at {state_path}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.out_dir)  # temps of saves killed mid-write in an earlier run
        torch.manual_seed(cfg.seed)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.lm = load_lm(cfg.init, cfg.model, cfg.max_len, cfg.seed, self.device)
        self.tokenizer = self.lm.tokenizer
        self.pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        self.setup()
        self.module = self.trainable_module()
        self._loss_module: nn.Module | None = None  # built at the first step (DDP under torchrun)
        self._whole: WholeCopy | None = None  # FSDP: unsharded copy (eval, export, sampling)
        if self.dist.shards_parameters:
            self._shard()
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            raise ConfigError(f"{self.name}: nothing to train (every parameter is frozen)")
        self.optimizer = build_adamw(self.module, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
        self.sampler = EpochSampler(
            self.num_examples(), cfg.batch_size, cfg.seed, self.dist.rank, self.dist.world_size
        )
        self.step, self.elapsed = 0, 0.0
        if resume:
            self._load_state(state_path)
        if self.dist.is_main:
            self.metrics = MetricsLog(self.out_dir, resume=resume)
            write_json(self.out_dir / f"{self.name}_config.json", cfg.to_dict())
        else:
            self.metrics = NullMetrics()
        n_train = sum(p.numel() for p in params)
        n_all = sum(p.numel() for p in self.module.parameters())
        self.log(f"{self.name}: {n_train:,} of {n_all:,} parameters trainable; {self.device}")

    # ---- FSDP --------------------------------------------------------------------------------
    def _shard(self) -> None:
        """Shard the trainable module in place (before the optimizer is built: FSDP2 replaces
        the parameters), after the ranks that need one have kept a whole copy of it."""
        keep = self.dist.is_main or self.whole_copy_everywhere
        self._whole = WholeCopy(self.module, keep, self.device, not self.whole_copy_everywhere)
        self._loss_module = self.dist.wrap(LossModule(self, self.module))

    @contextlib.contextmanager
    def whole_weights(self) -> Iterator[bool]:
        """Collective under FSDP (every rank enters it at the same point): for the body, this
        rank sees the current model whole wherever the trainer refers to it (self.module,
        self.lm.model, a rollout engine's policy, a critic) and the context yields True; a
        rank that keeps no whole copy yields False. Without sharding it is free and yields
        True: every rank's own module is whole."""
        if not self.dist.shards_parameters:
            yield True
            return
        self._whole.refresh(self.module, self.dist.full_tensor, self.step)  # every rank joins
        if self._whole.copy is None:
            yield False
            return
        with self._whole.swapped_in(self, self.module):
            yield True

    def sharded_call(self, fn: Callable[[Any], Any], batch: Any) -> Any:
        """`fn(batch)`, a loss computed with the trainable module; under FSDP inside one forward
        of the sharded root, whose pre-forward hook gathers the root-level parameters
        (embedding, final norm, head) that `hidden_states` / `lm_head` calls read, and whose
        backward reduce-scatters the gradients (their mean over ranks)."""
        if not self.dist.shards_parameters:
            return fn(batch)
        return self._loss_module(batch, fn)

    # ---- hooks -------------------------------------------------------------------------------
    @abstractmethod
    def setup(self) -> None:
        """Load data, wrap the model (PEFT, heads), build frozen copies."""

    def trainable_module(self) -> torch.nn.Module:
        """The module whose requires_grad parameters are optimised and saved in the state."""
        return self.lm.model

    @abstractmethod
    def num_examples(self) -> int:
        """How many training examples the sampler draws from."""

    @abstractmethod
    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The collated training batch for these example indices (on self.device)."""

    @abstractmethod
    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss to backpropagate, extra metrics to log) for one batch."""

    def loss_weight(self, batch: dict[str, torch.Tensor]) -> float:
        """How much this rank's slice counts in the batch's mean loss: its rows (a loss averaged
        over rows); a loss averaged over tokens returns its token count."""
        return float(next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0])

    def evaluate(self) -> dict[str, float]:
        return {}

    def should_stop(self, evaluated: dict[str, float]) -> bool:
        """Whether to end the run early after this evaluation (e.g. a target loss reached)."""
        return False

    def export(self, path: Path) -> None:
        """Write the model users load (HF layout)."""
        LM(self.lm.model, self.tokenizer).save(path)

    # ---- state -------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """Rank 0 writes (under DDP every rank holds the same weights and optimizer state;
        under FSDP every rank first joins the gathers of the weights and optimizer state)."""
        optimizer = whole_optimizer_state(self.optimizer, self.dist)  # collective under FSDP
        with self.whole_weights() as whole:
            if not (whole and self.dist.is_main):
                return
            self.export(self.out_dir)
            trainable = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
            state = {
                "step": self.step,
                "elapsed": self.elapsed,
                "trainable": trainable,
                "optimizer": optimizer,
                "sampler": self.sampler.state_dict(),
                "rng": rng_state(),
            }
            save_training_state(self.out_dir / STATE_FILE, state)

    def _load_state(self, path: Path) -> None:
        state = load_training_state(path)
        params = dict(self.module.named_parameters())
        missing = sorted(set(state["trainable"]) - set(params))
        if missing:
            raise CheckpointError(f"{path}: saved for a different model ({missing[:3]} missing)")
        with torch.no_grad():
            for n, value in state["trainable"].items():
                params[n].copy_(self.dist.shard_like(value, params[n]))
        load_optimizer_state(self.optimizer, state["optimizer"], self.dist)
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.log(f"resumed from step {self.step}")

    # ---- the loop ----------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        lr = cosine_lr(self.step, cfg.lr, cfg.min_lr, cfg.warmup_iters, cfg.max_iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.module.train()
        if self._loss_module is None:
            # every step uses the same parameters, unless experts are picked per token (MoE)
            self.dist.static_graph = self.lm.config.mlp != "moe"
            self._loss_module = self.dist.wrap(LossModule(self, self.module))
        batch = self.batch(self.sampler.next())
        loss, stats = self._loss_module(batch)
        # this rank's share: scale by weight * world / total weight, so that DDP's mean of the
        # ranks' gradients (and the mean of the logged values) is the whole batch's
        weight = self.loss_weight(batch)
        total, bad = self.dist.sum([weight, float(not math.isfinite(loss.item()))])
        if bad:
            raise NonFiniteLoss(
                f"{self.name} loss became non-finite at step {self.step}; stopped, the last "
                f"good checkpoint in {self.out_dir} is kept (try a lower lr)"
            )
        share = weight * self.dist.world_size / total if total else 1.0  # 0: nothing to learn
        if share != 1.0:
            loss = loss * share
            stats = {k: v * share for k, v in stats.items()}
        loss.backward()
        params = [p for p in self.module.parameters() if p.grad is not None]
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": loss.item(), "lr": lr, **stats}

    def _evaluate(self) -> dict[str, float]:
        """Rank 0 evaluates (the other ranks hold the same weights, or under FSDP join the
        gather of them, and go on to the next step, where the all-reduce waits for rank 0)."""
        with self.whole_weights() as whole:
            if not (whole and self.dist.is_main):
                return {}
            was_training = self.module.training
            self.module.eval()
            with torch.no_grad():
                result = self.evaluate()
            self.module.train(was_training)
        if result:
            self.metrics.log(self.step, "eval", **result)
        return result

    def run(self) -> dict[str, Any]:
        """Train to max_iters with periodic eval/checkpoints; returns the final metrics."""
        cfg = self.cfg
        bar = None
        if cfg.progress and self.dist.is_main:
            from tqdm import tqdm

            bar = tqdm(total=cfg.max_iters, initial=self.step, unit="it", dynamic_ncols=True)
        result: dict[str, Any] = {}
        if self.step == 0:
            result = {f"initial_{k}": v for k, v in self._evaluate().items()}
        try:
            while self.step < cfg.max_iters:
                t0 = time.perf_counter()
                stats = self._global(self.train_step())
                self.elapsed += time.perf_counter() - t0
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix({k: f"{v:.4g}" for k, v in stats.items() if k != "lr"})
                if self.step % cfg.log_interval == 0 or self.step == 1:
                    self.metrics.log(self.step, "train", **stats)
                stop = False
                if self.step % cfg.eval_interval == 0 or self.step >= cfg.max_iters:
                    evaluated = self._evaluate()
                    result.update(evaluated)
                    stop = self.dist.broadcast_flag(self.should_stop(evaluated))
                    if bar is not None and evaluated:
                        line = ", ".join(f"{k} {v:.4g}" for k, v in evaluated.items())
                        bar.write(f"step {self.step}: {line}")
                if self.step % cfg.checkpoint_interval == 0 or self.step >= cfg.max_iters or stop:
                    self.save_checkpoint()
                if stop:
                    break
        except KeyboardInterrupt:
            self.save_checkpoint()
            self.log(f"\ninterrupted: checkpoint saved at step {self.step}; continue with --resume")
            raise
        finally:
            if bar is not None:
                bar.close()
            self.metrics.close()
        result.update(step=self.step, elapsed_s=self.elapsed)
        if self.dist.is_main:
            write_json(self.out_dir / "final_metrics.json", result)
        plot = self.metrics.plot(
            self.curves, self.out_dir / f"{self.name}.png", title=f"{self.name} {self.out_dir.name}"
        )
        result["plot"] = str(plot)
        return result

    def _global(self, stats: dict[str, float]) -> dict[str, float]:
        """The mean over ranks of each rank's step metrics: the batch's values (train_step
        scales each rank's share; an RL rank reports on its own prompts, all of equal size)."""
        if self.dist.world_size == 1:
            return stats
        keys = sorted(stats)
        sums = self.dist.sum([float(stats[k]) for k in keys])
        return {k: v / self.dist.world_size for k, v in zip(keys, sums)}
