"""Multi-process training on PyTorch's own engine: `torchrun` -> process group -> DDP or FSDP2.

A trainer asks `setup_parallel(cfg, device)` for a `Parallel` and calls the same few methods
whether it runs alone or under torchrun: `wrap` the model, `no_sync` while accumulating,
`mean` a loss across ranks, `rank_zero_first` for work that writes shared files. Without torchrun
(no RANK/WORLD_SIZE in the environment) the base class is a no-op: one process, a world of one.

Batch convention (nanoGPT's): `batch_size` is the micro-batch of one forward pass on one rank and
`grad_accum` the number of micro-batches in ONE optimizer step across ALL ranks, so the global
batch is batch_size * grad_accum sequences whatever the world size; each rank runs
grad_accum / world_size of them (the per-rank accumulation), i.e.
global batch = batch_size * (grad_accum / world_size) * world_size. A world size that does not
divide grad_accum is a ConfigError before any step.

Data: the global batch is drawn as `grad_accum` independent random streams ("lanes"), lane j
seeded from (seed, j); rank r draws lanes [r*k, (r+1)*k) with k = grad_accum / world_size, and a
plain single-process run draws all of them itself (it is rank 0 of a world of one). The global
batch at step s therefore does not depend on how the run was launched: `lmforge pretrain` and
`torchrun --nproc_per_node N` train on the same data, and a checkpoint resumes exactly on a
different number of processes (lane states are saved per rank, read by any rank). Randomness
inside the model (dropout) is seeded per (seed, step, lane) for the same reason
(`micro_batch_seed`, in samplers.py).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge.errors import ConfigError, require_choice
from lmforge.train import sharded_checkpoint as dcp_ckpt
from lmforge.train.checkpoint import STATE_FILE, check_signature, rng_state, set_rng_state
from lmforge.train.samplers import check_world_size
from lmforge.train.stop import agree_stop, stop_pending


def launched_by_torchrun() -> bool:
    """True when torchrun (or any launcher using its env protocol) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block in the backward pass instead of storing its activations
    (torch.utils.checkpoint, non-reentrant): ~1/3 more compute for activation memory that no
    longer grows with depth. Patching the instance's forward keeps parameter names unchanged.
    Every block inside `model` (`transformer_blocks`) is patched once; a second call is a no-op."""
    for block in transformer_blocks(model):
        if "forward" not in vars(block):  # not patched yet
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of every `blocks` ModuleList inside `model` (a Transformer, or a module that
    holds one: a reward model, a post-training loss): FSDP2's per-block units."""
    return [b for m in model.modules() if isinstance(getattr(m, "blocks", None), nn.ModuleList)
            for b in m.blocks]  # fmt: skip


class Parallel:
    """One process, no process group: rank 0 of a world of one. Communication is the identity;
    the data lanes and the batch split are the general rule with world_size 1."""

    name = "single"
    shards_parameters = False  # True: each rank holds a slice of every parameter (FSDP)
    sharded = False  # checkpoint format: False = one atomic file, True = DCP directory
    state_file = STATE_FILE  # what --resume looks for in out_dir

    def __init__(self, device: torch.device, activation_checkpointing: bool = False):
        self.device, self.activation_checkpointing = device, activation_checkpointing
        self.rank, self.world_size = 0, 1
        self.module: nn.Module | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, shows progress and writes shared files."""
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to call for training steps (the model itself, or its DDP/FSDP wrapper)."""
        if self.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.module = self._wrap(model)
        return self.module

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, last: bool):
        """Context for one micro-batch's forward+backward: gradients are reduced across ranks
        only on the last micro-batch of a step."""
        return contextlib.nullcontext()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks of a short list of floats (one all-reduce)."""
        return list(values)

    def mean(self, stats: dict[str, float]) -> dict[str, float]:
        """The mean over ranks of metrics each rank computed on its own share (one all-reduce)."""
        sums = self.sum([float(v) for v in stats.values()])
        return {k: v / self.world_size for k, v in zip(stats, sums)}

    def broadcast_flag(self, flag: bool) -> bool:
        """Rank 0's value of a flag on every rank (e.g. "stop now" after a rank-0 evaluation)."""
        return flag

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Rank 0 runs the body (train the tokenizer, build shards), then the others, which
        then find its output on the shared file system and reuse it."""
        yield

    def full_model(self, model: nn.Module) -> nn.Module | None:
        """The unsharded model on rank 0 (to save in HF layout or sample from); None elsewhere.
        Every rank must call it (FSDP gathers the shards)."""
        return model if self.is_main else None

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of a parameter (or of optimizer state shaped like one), detached. Every rank
        must call it, in the same order (FSDP all-gathers the slices of a DTensor)."""
        from torch.distributed.tensor import DTensor

        tensor = tensor.detach()
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def shard_like(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full`, laid out as `param` is (a DTensor under FSDP; the inverse
        of full_tensor; every rank passes the same `full`, no communication)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(param, DTensor):
            return full
        full = full.to(device=param.device, dtype=param.dtype)
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


# the DDP argument that turns off the per-forward buffer broadcast (renamed in torch 2.13)
_NO_BUFFER_SYNC = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel).parameters
    else "broadcast_buffers"
)


class DDPParallel(Parallel):
    """DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets."""

    name = "ddp"
    sharded = True
    state_file = f"{dcp_ckpt.CHECKPOINT_DIR}/{dcp_ckpt.LATEST}"
    # static_graph: the same parameters take part in every step (a post-training loss), so DDP
    # learns once which ones a loss leaves out (e.g. a reward model's unused LM head)
    static_graph = False
    sync_buffers = True  # rank 0's buffers sent at every forward (DDP's default)
    # a loss that leaves some parameters out at some steps (PPO's critic warm-up, MoE experts)
    find_unused_parameters = False

    def __init__(self, device: torch.device, activation_checkpointing: bool = False):
        super().__init__(device, activation_checkpointing)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def _wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        # experts no token was routed to get no gradient: neither all used nor a static graph
        moe = getattr(getattr(model, "config", None), "mlp", None) == "moe"
        return nn.parallel.DistributedDataParallel(
            model, device_ids=ids, find_unused_parameters=moe or self.find_unused_parameters,
            static_graph=self.static_graph and not moe,
            **({} if self.sync_buffers else {_NO_BUFFER_SYNC: False}),
        )  # fmt: skip

    def no_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.module.no_sync()

    def sum(self, values: list[float]) -> list[float]:
        t = torch.tensor([*values, float(stop_pending())], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)  # SUM: gloo has no AVG
        *sums, stops = t.tolist()
        agree_stop(bool(stops))  # some rank was asked to stop: every rank stops after this step
        return sums

    def broadcast_flag(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], device=self.device)
        dist.broadcast(t, src=0)
        return bool(t.item())

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        if not self.is_main:
            dist.barrier()
        yield
        if self.is_main:
            dist.barrier()

    def save_state(self, out_dir: Path, model, optimizer, sampler, meta: dict[str, Any]) -> None:
        """Collective: a sharded DCP checkpoint of model + optimizer, meta and per-rank JSON."""
        rank_state = {"sampler": sampler.state_dict(), "rng": rng_state(json_safe=True)}
        meta = {**meta, "parallel": self.name}
        dcp_ckpt.save_sharded(Path(out_dir) / dcp_ckpt.CHECKPOINT_DIR, model, optimizer, meta,
                             rank_state)  # fmt: skip

    def load_state(self, path: Path, model, optimizer, sampler, model_config: dict) -> dict:
        """Collective: check the checkpoint (complete, same model config) BEFORE loading, fill
        model, optimizer, this rank's data lanes and RNG, and return meta (step, ...)."""
        step_dir = dcp_ckpt.resolve_checkpoint(path)
        meta = dcp_ckpt.check_checkpoint(step_dir)
        check_signature(step_dir, meta["model_config"], model_config)
        ranks = dcp_ckpt.read_rank_states(step_dir, meta["world_size"])
        lanes = {k: v for r in ranks for k, v in r["sampler"]["lanes"].items()}
        sampler.load_state_dict({"lanes": lanes})
        dcp_ckpt.load_sharded(step_dir, model, optimizer)
        if meta["world_size"] == self.world_size:  # else: no per-rank stream to continue
            set_rng_state(ranks[self.rank]["rng"])
        return meta


class FSDPParallel(DDPParallel):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks,
    gathered block by block for compute. Each block is its own unit, then the root (embeddings,
    final norm, head), so at most one block's full weights are live beyond the root's."""

    name = "fsdp"
    shards_parameters = True

    def _wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        for block in transformer_blocks(model):
            fully_shard(block)
        return fully_shard(model)

    @contextlib.contextmanager
    def no_sync(self, last: bool) -> Iterator[None]:
        self.module.set_requires_gradient_sync(last)
        yield

    def full_model(self, model: nn.Module) -> nn.Module | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from lmforge.model.io import build_model

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=opts)  # full tensors on rank 0 only
        return build_model(model.config, state) if self.is_main else None


PARALLEL: dict[str, type[DDPParallel]] = {"ddp": DDPParallel, "fsdp": FSDPParallel}


def _quiet_print() -> None:
    """print() on ranks other than 0 prints nothing unless print(..., force=True), so every CLI
    logs once (torchvision's recipe)."""
    builtin_print = builtins.print

    def print_(*args, force: bool = False, **kwargs) -> None:
        if force:
            builtin_print(*args, **kwargs)

    builtins.print = print_


def cleanup() -> None:
    """Leave the process group (registered atexit; safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def setup_parallel(cfg, device: torch.device) -> Parallel:
    """The Parallel for this process: the single-process no-op, or (under torchrun) a joined
    process group, gloo on CPU / NCCL on CUDA, with cfg.parallel ('ddp' or 'fsdp').

    Checks the configuration before any step: cfg.parallel is known and the world size divides
    cfg.grad_accum (see the batch convention above).
    """
    require_choice("parallel", cfg.parallel, PARALLEL)
    torchrun = launched_by_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else 1
    check_world_size(cfg.optim.grad_accum, world, "grad_accum", "micro-batches")
    if torchrun and cfg.parallel == "fsdp" and cfg.dtype == "float16":
        raise ConfigError("parallel=fsdp does not support float16 loss scaling; use bfloat16")
    return init_parallel(cfg.parallel, device, cfg.activation_checkpointing)


def init_parallel(
    parallel: str, device: torch.device, activation_checkpointing: bool = False
) -> Parallel:
    """Join torchrun's process group (gloo on CPU, NCCL on CUDA; once per process) and return
    the `parallel` ('ddp' or 'fsdp') strategy; the single-process no-op without torchrun.
    Trainers check their own batch against the world size before calling it."""
    if not launched_by_torchrun():
        return Parallel(device, activation_checkpointing)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        atexit.register(cleanup)
    if dist.get_rank() != 0:
        _quiet_print()
    return PARALLEL[parallel](device, activation_checkpointing)
