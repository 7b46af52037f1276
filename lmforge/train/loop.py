"""The one training loop: pretraining, SFT/PEFT, reward models, DPO, RL (GRPO, PPO, RSFT), BERT
masked-LM pretraining, classification, seq2seq and the VLM all run `Trainer.run`.

A trainer subclasses `Trainer` and supplies only what is its own:

    next_batch()       the data of one step (RL: a sampled and scored rollout)
    loss(batch)        (loss tensor, metrics): a pure function of the batch and the weights
    evaluate()         held-out metrics
    export(path)       the model users load
    data_state() / load_data_state(state)   where its data stream is (for an exact resume)

The loop does the rest the same way for every trainer:

- AdamW, or Muon + AdamW (`build_optimizer`), with linear warmup + cosine decay (`cosine_lr`)
  or warmup-stable-decay (`wsd_lr`). The step index is the number of optimizer steps already
  taken: the first step runs at lr / (warmup_iters + 1).
- Gradient accumulation over micro-batches, each weighted by its share of the batch
  (`loss_weight`: rows, or tokens for a token-mean loss), so the update is that of the whole
  batch; under torchrun the shares are of the global batch and DDP/FSDP reduce the gradients
  (nothing all-reduces by hand): the trainer picks how, `LoopWrapsLoss` (the loss runs inside
  one wrapped call of `LossModule`) or `TrainerWrapsModel` (pretraining wraps its own model).
- A NaN/inf guard BEFORE the optimizer step (`NonFiniteLoss`): a bad step never reaches the
  weights or AdamW's moments, and the last good checkpoint is kept.
- Gradient clipping, fp16 loss scaling (`dtype`), autocast.
- Evaluation, logging and checkpoint cadence; a metrics CSV and a PNG of the curves.
- Ctrl-C and SIGTERM: the stop is taken between two steps (under torchrun, after the same step
  on every rank), a checkpoint is saved and `--resume` continues exactly; a second signal before
  the step ends stops at once without saving (the last checkpoint is kept).
- An exact resume: weights, optimizer, data position, RNG and loss scale in one atomic
  safetensors file (or, for pretraining under torchrun, a sharded DCP checkpoint).
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmforge.errors import (
    CheckpointError,
    ConfigError,
    LMForgeError,
    NonFiniteLoss,
    Terminated,
)
from lmforge.fileio import remove_stale_temps, write_json
from lmforge.model.info import model_flops_utilisation
from lmforge.model.modes import eval_mode
from lmforge.progress import progress_bar
from lmforge.train.checkpoint import (
    STATE_FILE,
    check_signature,
    load_optimizer_state,
    load_training_state,
    rng_state,
    save_training_state,
    set_rng_state,
    whole_optimizer_state,
)
from lmforge.train.metrics import MetricsLog
from lmforge.train.optim import LossScaler, build_optimizer
from lmforge.train.parallel import Parallel, launched_by_torchrun
from lmforge.train.stop import handling_signals, request_stop, reset_stop, stop_pending, take_stop
from lmforge.train.whole_copy import LoopWrapsLoss

AUTOCAST_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def training_dtype(name: str, device: torch.device) -> str:
    """The autocast dtype name of a training run's `dtype` setting (one of AUTOCAST_DTYPES or
    `auto`, as TrainConfig checks). `auto` picks the fastest safe one: bf16 where the hardware
    does bf16 matmuls natively (CUDA with bf16, CPUs with AMX), fp16 on older GPUs, fp32
    otherwise."""
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if device.type == "cpu" and torch.cpu._is_amx_tile_supported():
        return "bfloat16"
    return "float32"


# metrics the progress line leaves out (lr) or shows in their own form (throughput_text)
NOT_SHOWN = ("lr", "tokens_per_s", "mfu")


def throughput_text(stats: dict[str, float]) -> dict[str, str]:
    """tokens/s and MFU as the progress line shows them (`Trainer.throughput`'s keys)."""
    out = {"tokens/s": f"{stats['tokens_per_s']:,.0f}"}
    if "mfu" in stats:
        out["mfu"] = f"{stats['mfu']:.1%}"
    return out


def split_rows(batch: Any, parts: int) -> list[Any]:
    """A batch (a tensor, or a dict / tuple of tensors sharing their first dimension) cut into
    `parts` micro-batches of consecutive rows, for gradient accumulation."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if len(batch) < parts:
            raise ConfigError(f"grad_accum={parts} exceeds the {len(batch)} rows of a batch")
        return list(batch.tensor_split(parts))
    if isinstance(batch, dict):
        cut = {k: split_rows(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in cut.items()} for i in range(parts)]
    if isinstance(batch, tuple | list):
        cut = [split_rows(v, parts) for v in batch]
        return [type(batch)(v[i] for v in cut) for i in range(parts)]
    raise ConfigError(f"grad_accum={parts}: this trainer's batches cannot be split")


def stop_between_steps(hard_stop: bool):
    """While the loop runs, SIGINT and SIGTERM ask for a stop that the loop takes after the
    current step (`request_stop`), so the checkpoint it saves is a step boundary. A second signal
    before that stop is taken raises at once (`hard_stop`; not under torchrun, whose launcher
    SIGKILLs a worker that does not end)."""

    def handler(signum: int) -> None:
        if hard_stop and stop_pending():
            raise Terminated(f"signal {signum}") if signum == signal.SIGTERM else KeyboardInterrupt
        request_stop(signum)

    return handling_signals((signal.SIGINT, signal.SIGTERM), handler)


class Trainer(ABC):
    """The shared loop; see the module docstring for what a subclass supplies.

    A subclass's __init__ calls `open_run` (settings, device, output folder, and how the run
    meets DDP/FSDP: `LoopWrapsLoss` or `TrainerWrapsModel`), builds its data and model, then
    `start(module)` (sharding, optimizer, resume, metrics log).
    """

    name = "train"
    curves: list[tuple[str, str]] = [("train", "loss")]
    plot_file: str | None = None  # None: f"{name}.png"
    config_file = "train_config.json"
    eval_split = "eval"  # the metrics.csv split evaluations are logged under

    # ---- setup -----------------------------------------------------------------------------------
    def open_run(
        self, cfg: Any, dist: Parallel, resume: bool, log=print,
        wrapping: LoopWrapsLoss | None = None, evaluate_first: bool = False,
    ) -> None:  # fmt: skip
        """Settings, device, torch threads (a `threads` setting), output folder, how the run
        meets DDP/FSDP (`wrapping`, default LoopWrapsLoss()) and whether it evaluates before the
        first step (results as initial_*); checks that --resume has a state to resume."""
        if getattr(cfg, "threads", None):
            torch.set_num_threads(cfg.threads)
        self.cfg, self.dist, self.resume = cfg, dist, resume
        self.wrapping, self.evaluate_first = wrapping or LoopWrapsLoss(), evaluate_first
        self.log = log if dist.is_main else lambda *args, **kwargs: None
        self.device = dist.device
        self.out_dir = Path(cfg.out_dir)
        # every rank writes its part of a sharded checkpoint directory, or rank 0 one file
        self.sharded_state = self.wrapping.sharded_state and dist.sharded
        self.state_path = self.out_dir / (dist.state_file if self.sharded_state else STATE_FILE)
        if resume and not self.state_path.is_file():
            raise CheckpointError(f"--resume: no training state at {self.state_path}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.out_dir)  # temps of saves killed mid-write in an earlier run
        self.step, self.elapsed, self.cpu_elapsed, self.tokens_seen = 0, 0.0, 0.0, 0
        self.tokens_per_step = 0  # tokens of one step's batch, where that is a fixed number
        # model FLOPs utilisation reported beside tokens/s when both are known (pretraining)
        self.flops_per_token = 0.0  # training FLOPs per token; 0: unknown
        self.peak_tflops: float | None = None  # the device's peak
        self.dtype = "float32"
        self.scaler: LossScaler | None = None
        self.model_config: Any = getattr(self, "model_config", None)  # DDP's MoE check, resume
        self._saved_at = -1

    def start(self, module: nn.Module) -> None:
        """`module` holds the trained parameters: shard it (FSDP), build AdamW over its
        requires_grad parameters, resume, open the metrics log."""
        cfg = self.cfg
        self.module = module
        if self.model_config is None:
            self.model_config = getattr(module, "config", None)
        self.wrapping.attach(module, self.model_config, self.dist)
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError(f"{self.name}: nothing to train (every parameter is frozen)")
        if cfg.optim.optimizer == "muon" and self.dist.shards_parameters:
            raise ConfigError("optimizer: muon needs whole matrices; use parallel: ddp, not fsdp")
        self.optimizer = build_optimizer(module, cfg.optim)
        if self.dtype == "float16":
            self.scaler = LossScaler()
        if self.resume:
            self.load_checkpoint(self.state_path)
        out = self.out_dir if self.dist.is_main else None
        self.metrics = MetricsLog(out, getattr(cfg, "tensorboard", False), self.resume)
        if self.dist.is_main:
            write_json(self.out_dir / self.config_file, cfg.to_dict())

    def autocast(self):
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.dtype])

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Train to max_iters (or until should_stop / out_of_time) with periodic evaluation and
        checkpoints; then final evaluations, metrics and plot. Returns the final metrics."""
        cfg = self.cfg.optim
        show = cfg.progress and self.dist.is_main
        # a bar on a terminal, a plain line every few seconds in a redirected log
        bar = progress_bar(total=cfg.max_iters, initial=self.step, desc=self.name, disable=not show)
        result: dict[str, Any] = {}
        every = cfg.checkpoint_interval or cfg.eval_interval
        window_tokens, window_start = 0, time.perf_counter()
        # throughput after the warm-up: the steps after this process's first log_interval
        # (compilation, autotuning and the allocator's growth happen in the first steps)
        warm_steps, steady_steps, steady_seconds = cfg.log_interval, 0, 0.0
        first_step = self.step
        throughput: dict[str, str] = {}
        in_step = False
        reset_stop()
        try:
            with stop_between_steps(hard_stop=not launched_by_torchrun()):
                if self.evaluate_first and self.step == 0:
                    result = {f"initial_{k}": v for k, v in self._evaluate().items()}
                while self.step < cfg.max_iters:
                    in_step = True
                    t0, c0 = time.perf_counter(), time.process_time()
                    stats = self.train_step()
                    in_step = False
                    self.elapsed += time.perf_counter() - t0
                    if self.step - first_step > warm_steps:
                        steady_steps += 1
                        steady_seconds += time.perf_counter() - t0
                    self.cpu_elapsed += time.process_time() - c0
                    bar.update(1)
                    window_tokens += self.tokens_per_step  # 0: no throughput to report
                    if self.step % cfg.log_interval == 0 or self.step == 1:
                        if self.tokens_per_step:
                            now = time.perf_counter()
                            rate = window_tokens / max(1e-9, now - window_start)
                            stats.update(self.throughput(rate))
                            window_tokens, window_start = 0, now
                            throughput = throughput_text(stats)
                        self.metrics.log(self.step, "train", **stats)
                    shown = {k: f"{v:.4g}" for k, v in stats.items() if k not in NOT_SHOWN}
                    bar.set_postfix(shown | throughput)  # the last window's, between windows
                    stop = self.out_of_time()
                    last = self.step >= cfg.max_iters or stop
                    if self.step % cfg.eval_interval == 0 or last:
                        evaluated = self._evaluate()
                        result.update(evaluated)
                        stop = self.dist.broadcast_flag(self.should_stop(evaluated)) or stop
                        if show and evaluated:
                            bar.write(self.eval_line(evaluated))
                    if self.step % every == 0 or last or stop:
                        self.save_checkpoint()
                    if stop:
                        break
                    if (signum := take_stop(self.dist.world_size)) is not None:
                        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        except KeyboardInterrupt:
            if in_step:
                self.log(f"\nstopped during step {self.step + 1}: not saved; the checkpoint of "
                         "the last saved step is kept")  # fmt: skip
                raise
            if self._saved_at != self.step:
                self.save_checkpoint()
            self.log(f"\ninterrupted: checkpoint saved at step {self.step}; continue with --resume")
            raise
        finally:
            bar.close()
            self.metrics.close()
        if self.step == first_step:  # resumed at max_iters: nothing trained, still report
            result.update(self._evaluate())
        result = self.finish(result)
        result.update(step=self.step, elapsed_s=self.elapsed)
        if self.tokens_per_step:
            result.update(self.throughput(self.tokens_seen / max(1e-9, self.elapsed)))
            if steady_steps:
                rate = steady_steps * self.tokens_per_step / max(1e-9, steady_seconds)
                result.update({f"{k}_after_warmup": v for k, v in self.throughput(rate).items()})
                result["warmup_steps"] = warm_steps
        if self.dist.is_main:
            write_json(self.out_dir / "final_metrics.json", result)
        path = self.out_dir / (self.plot_file or f"{self.name}.png")
        plot = self.metrics.plot(self.curves, path, title=f"{self.name} {self.out_dir.name}")
        result["plot"] = str(plot)
        return result

    def throughput(self, tokens_per_s: float) -> dict[str, float]:
        """{tokens_per_s, and mfu (a fraction) where the FLOPs per token and the device's peak
        are known}."""
        out = {"tokens_per_s": tokens_per_s}
        if self.flops_per_token and self.peak_tflops:
            out["mfu"] = model_flops_utilisation(
                tokens_per_s, self.flops_per_token, self.peak_tflops
            )
        return out

    # ---- one step --------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One step: learning rate, batch, update(s). Returns its metrics, the same on every
        rank (the global batch's)."""
        lr = self.cfg.optim.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        self.module.train()
        stats = self.learn(self.next_batch())
        self.step += 1
        self.tokens_seen += self.tokens_per_step
        return {**stats, "lr": lr}

    def optimizer_step(
        self, micro_batches: list[Any], loss_fn: Callable[[Any], tuple] | None = None
    ) -> dict[str, float]:
        """One optimizer update from the gradients of `micro_batches` under `loss_fn` (default:
        self.loss); returns the weighted mean loss and metrics over the global batch. Collective
        under torchrun (every rank calls it at the same point with its own micro-batches)."""
        fn = loss_fn or self.loss
        world = self.dist.world_size
        weights = [float(self.loss_weight(mb)) for mb in micro_batches]
        total = sum(weights)
        if world > 1:
            total = self.dist.sum([total])[0]
            self.wrapping.before_update()
        loss_sum = torch.zeros((), device=self.device)
        sums: dict[str, float] = {}
        last = len(micro_batches) - 1
        for i, (mb, weight) in enumerate(zip(micro_batches, weights)):
            # this micro-batch's share of the global batch (0 total: nothing to learn, as is);
            # DDP then averages over ranks, hence the factor world
            share = weight * world / total if total else 1.0
            with self.dist.no_sync(last=i == last):  # reduce gradients once per update
                with self.autocast():
                    # under torchrun the loss may run inside one DDP/FSDP call (LoopWrapsLoss)
                    wrapped = self.wrapping.loss_module
                    loss, stats = fn(mb) if wrapped is None else wrapped(mb, fn)
                    if share != 1.0:
                        loss = loss * share
                (loss * self.scaler.scale if self.scaler else loss).backward()
            loss_sum += loss.detach().float()  # one host sync per update, not per micro-batch
            for k, v in stats.items():
                v = v.detach() if isinstance(v, torch.Tensor) else v
                sums[k] = sums.get(k, 0.0) + share * float(v)
        local = loss_sum.item()
        keys = list(sums)
        values = [local, float(not math.isfinite(local)), *(sums[k] for k in keys)]
        if world > 1:
            values = self.dist.sum(values)
        value = values[0] / world
        # checked BEFORE the update: a NaN step must not reach the weights or AdamW's moments
        if values[1] or not math.isfinite(value):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLoss(
                f"{self.name}: loss became {value} at step {self.step}; stopped before the "
                f"optimizer step. The last good checkpoint in {self.out_dir} is kept (lower lr, "
                "or use bfloat16 instead of float16)."
            )
        params = [p for p in self.module.parameters() if p.grad is not None]
        grad_norm = float("nan")  # a float16 step skipped for overflow
        if self.scaler is None or self.scaler.unscale_and_check(params):
            # the global norm before clipping (what TRL/transformers log as grad_norm)
            clip = self.cfg.optim.grad_clip or float("inf")
            norm = torch.nn.utils.clip_grad_norm_(params, clip) if params else torch.zeros(())
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.wrapping.updated()
        stats = {k: v / world for k, v in zip(keys, values[2:])}
        return {"loss": value, "grad_norm": grad_norm, **stats}

    # ---- evaluation and whole weights (FSDP) -----------------------------------------------------
    def _evaluate(self) -> dict[str, float]:
        """`evaluate()` on the ranks that evaluate (`wrapping.evaluating`), logged."""
        with self.wrapping.evaluating(self, self.step) as here:
            if not here:
                return {}
            with eval_mode(self.module), torch.no_grad():
                result = self.evaluate()
        if result:
            self.log_evaluation(result)
        return result

    def whole_weights(self) -> contextlib.AbstractContextManager[bool]:
        """Collective under FSDP (every rank enters it at the same point): for the body, this
        rank sees the current model whole wherever the trainer refers to it (self.module, an
        LM, a rollout engine's policy, a critic) and the context yields True; a rank that keeps
        no whole copy yields False. Without sharding it is free and yields True."""
        return self.wrapping.whole_weights(self, self.step)

    # ---- state -----------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        """The exported model (for users) and the training state (for --resume). Collective
        under torchrun; rank 0 writes the one-file state (under FSDP from whole weights)."""
        self._saved_at = self.step
        progress = {
            "step": self.step, "elapsed": self.elapsed, "cpu_elapsed": self.cpu_elapsed,
            "tokens_seen": self.tokens_seen, "model_config": self.signature(),
            "scaler": self.scaler.state_dict() if self.scaler else None,
        }  # fmt: skip
        if self.sharded_state:
            self.export(self.out_dir)  # collective: gathers the shards
            self.dist.save_state(self.out_dir, self.module, self.optimizer, self.sampler, progress)
            return
        optimizer = whole_optimizer_state(self.optimizer, self.dist)  # collective under FSDP
        with self.whole_weights() as whole:
            if not (whole and self.dist.is_main):
                return
            self.export(self.out_dir)
            trainable = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
            state = {
                **progress,
                "trainable": trainable,
                "optimizer": optimizer,
                "data": self.data_state(),
                "rng": rng_state(),
                "extra": self.extra_state(),
            }
            save_training_state(self.out_dir / STATE_FILE, state)

    def load_checkpoint(self, path: Path) -> None:
        """Restore a state written by save_checkpoint, after checking it fits this run."""
        if self.sharded_state:
            state = self.dist.load_state(
                path, self.module, self.optimizer, self.sampler, self.signature()
            )
        else:
            state = load_training_state(path)
            if "trainable" not in state:
                raise CheckpointError(f"{path}: written by an earlier lmforge; start a new out_dir")
            check_signature(path, state.get("model_config"), self.signature())
            params = {n: p for n, p in self.module.named_parameters() if p.requires_grad}
            if differ := sorted(set(state["trainable"]) ^ set(params)):
                raise CheckpointError(f"{path}: saved for a different model (trainable "
                                      f"parameters differ: {', '.join(differ[:3])})")  # fmt: skip
            with torch.no_grad():
                for n, value in state["trainable"].items():
                    params[n].copy_(self.dist.shard_like(value, params[n]))
            load_optimizer_state(self.optimizer, state["optimizer"], self.dist)
            try:
                self.load_data_state(state["data"])
            except LMForgeError as err:
                raise CheckpointError(f"{path}: {err}") from err
            set_rng_state(state["rng"])
            self.load_extra_state(state.get("extra") or {})
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.cpu_elapsed = state.get("cpu_elapsed", 0.0)
        self.tokens_seen = state.get("tokens_seen", 0)
        self.log(f"resumed from step {self.step}")

    # ---- what a trainer supplies -----------------------------------------------------------------
    @abstractmethod
    def next_batch(self) -> Any:
        """The data of one step."""

    def micro_batches(self, batch: Any) -> list[Any]:
        """The step's batch as grad_accum micro-batches."""
        return split_rows(batch, self.cfg.optim.grad_accum)

    @abstractmethod
    def loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """(loss to backpropagate, extra metrics) of one (micro-)batch."""

    def loss_weight(self, batch: Any) -> float:
        """How much this micro-batch counts in the step's mean loss: equal shares by default; a
        loss averaged over rows or tokens returns its row or token count."""
        return 1.0

    def learn(self, batch: Any) -> dict[str, float]:
        """What one step does with its batch: one optimizer step over its micro-batches (RL
        overrides it: several optimizer steps over minibatches of a rollout)."""
        return self.optimizer_step(self.micro_batches(batch))

    def evaluate(self) -> dict[str, float]:
        return {}

    def log_evaluation(self, result: dict[str, float]) -> None:
        self.metrics.log(self.step, self.eval_split, **result)

    def eval_line(self, result: dict[str, float]) -> str:
        return f"step {self.step}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items())

    def should_stop(self, evaluated: dict[str, float]) -> bool:
        """Whether to end the run early after this evaluation (e.g. a target loss reached)."""
        return False

    def out_of_time(self) -> bool:
        """Whether a time budget is spent (checked after every step; the run then ends)."""
        return False

    @abstractmethod
    def export(self, path: Path) -> None:
        """Write the model users load."""

    def data_state(self) -> Any:
        """Where the data stream is, saved for --resume: a `sampler`'s state, else that of the
        torch.Generator `generator` that draws the batches."""
        return self.sampler.state_dict() if hasattr(self, "sampler") else self.generator.get_state()

    def load_data_state(self, state: Any) -> None:
        if hasattr(self, "sampler"):
            self.sampler.load_state_dict(state)
        else:
            self.generator.set_state(state)

    def extra_state(self) -> dict[str, Any]:
        """Anything else a resumed run needs (e.g. the best step so far)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Restore what `extra_state` saved (nothing by default)."""

    def signature(self) -> dict[str, Any]:
        """Settings a resumed run must share with the saved one (the model's shape)."""
        config = self.model_config
        return config.to_dict() if hasattr(config, "to_dict") else {}

    def finish(self, result: dict[str, Any]) -> dict[str, Any]:
        """After the last step, before the final metrics are written (final evaluations)."""
        return result
