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
(`micro_batch_seed`).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import copy
import functools
import inspect
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lmforge.data import BatchSampler, TokenShard
from lmforge.errors import ConfigError, DataError, require_choice
from lmforge.train import sharded_checkpoint as dcp_ckpt
from lmforge.train.checkpoint import STATE_FILE, check_signature, rng_state, set_rng_state

# A stop (SIGTERM, Ctrl-C) asked for while the training loop runs. The loop takes it only between
# two steps, so the checkpoint it saves is the state after a whole step and a resume continues
# exactly. Under torchrun each rank gets the signal at its own point in a step, so none stops on
# its own: the request rides on the step's `sum` all-reduce (which every rank runs at the same
# place in every step), and all ranks stop after that same step, then save together.
_stop_requested: int | None = 0  # the signal asked for (0: none); None: taken, later ones ignored
_stop_agreed = False  # under torchrun: some rank asked, seen by all in the last `sum`


def request_stop(signum: int = signal.SIGINT) -> None:
    """Ask the training loop to stop after the current step (signal handlers call this)."""
    global _stop_requested
    if _stop_requested == 0:
        _stop_requested = signum


def stop_pending() -> bool:
    """Whether a stop was asked for and not yet taken (a second signal then means: now)."""
    return bool(_stop_requested)


def reset_stop() -> None:
    """Forget earlier requests (a training run starts listening afresh)."""
    global _stop_requested, _stop_agreed
    _stop_requested, _stop_agreed = 0, False


def take_stop(world_size: int) -> int | None:
    """At a step boundary: the signal to stop for, or None. Under torchrun only a request every
    rank saw (through the step's all-reduce) counts, so all ranks stop after the same step. Once
    taken, later requests are ignored: they must not interrupt the checkpoint save."""
    global _stop_requested
    if not (_stop_agreed if world_size > 1 else _stop_requested):
        return None
    signum = _stop_requested or signal.SIGINT
    _stop_requested = None
    return signum


@contextlib.contextmanager
def handling_signals(signums: tuple[int, ...], handler: Callable[[int], None]) -> Iterator[None]:
    """While the body runs, `handler(signum)` takes each of `signums` in this process; a process
    forked from it (a data worker) that inherits the handler dies by the signal's default action
    instead. Only the main thread can install handlers: in another thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def on_signal(signum, frame) -> None:
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        handler(signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in signums}
    try:
        yield
    finally:
        for signum, action in previous.items():
            signal.signal(signum, action)


def launched_by_torchrun() -> bool:
    """True when torchrun (or any launcher using its env protocol) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block in the backward pass instead of storing its activations
    (torch.utils.checkpoint, non-reentrant): ~1/3 more compute for activation memory that no
    longer grows with depth. Patching the instance's forward keeps parameter names unchanged."""
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of every `blocks` ModuleList inside `model` (a Transformer, or a module that
    holds one: a reward model, a post-training loss): FSDP2's per-block units."""
    return [b for m in model.modules() if isinstance(getattr(m, "blocks", None), nn.ModuleList)
            for b in m.blocks]  # fmt: skip


def lane_seed(seed: int, lane: int) -> int:
    """Seed of data lane `lane`; lane 0 uses `seed` itself (a plain BatchSampler's stream)."""
    return seed + 1_000_003 * lane


def micro_batch_seed(seed: int, step: int, lane: int) -> int:
    """Seed of the model's own randomness (dropout) for lane `lane` of optimizer step `step`.

    Seeding the global RNG with it before each micro-batch gives that micro-batch the same
    dropout masks on whichever rank, and after however many others, it runs: one process and N
    ranks apply the same masks, and a resume on another world size continues them exactly.
    """
    mixed = np.random.SeedSequence([seed, step, lane]).generate_state(2, np.uint32)
    return (int(mixed[0]) << 31) ^ int(mixed[1])  # < 2**63, what torch.manual_seed accepts


class LaneSampler:
    """This rank's share of the global batch: lanes [first, first + count), one BatchSampler each,
    drawn round-robin so call i of a step reads lane `lanes[i]` (all lanes on a single process)."""

    def __init__(self, shard: TokenShard, batch_size: int, block_size: int, seed: int,
                 lanes: range, device: str | torch.device = "cpu"):  # fmt: skip
        self.lanes = lanes
        self.samplers = {
            j: BatchSampler(shard, batch_size, block_size, lane_seed(seed, j), device)
            for j in lanes
        }
        self._calls = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        lane = self.lanes[self._calls % len(self.lanes)]
        self._calls += 1
        return self.samplers[lane].next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: {"lanes": {lane: BatchSampler state}} for this rank's lanes."""
        return {"lanes": {str(j): s.state_dict() for j, s in self.samplers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take this rank's lanes from a merged {"lanes": ...} of every saving rank."""
        if "lanes" not in state and "generator_state" in state:
            # a single-process checkpoint of an earlier lmforge: one BatchSampler stream, which is
            # lane 0's (lane_seed(seed, 0) == seed); it continues exactly only as the sole lane
            if len(self.lanes) != 1 or self.lanes[0] != 0:
                raise DataError(
                    "the checkpoint holds one data stream (a single-process run of an earlier "
                    "lmforge), which continues exactly only with grad_accum 1, not "
                    f"{len(self.lanes)}: start a new out_dir"
                )
            state = {"lanes": {"0": state}}
        saved = state.get("lanes", {})
        for j, sampler in self.samplers.items():
            if str(j) not in saved:
                raise DataError(
                    f"data lane {j} is not in the checkpoint (it has lanes "
                    f"{sorted(map(int, saved))}); resume with the same grad_accum"
                )
            sampler.load_state_dict(saved[str(j)])
        self._calls = 0


class Parallel:
    """One process, no process group: rank 0 of a world of one. Communication is the identity;
    the data lanes and the batch split are the general rule with world_size 1."""

    name = "single"
    shards_parameters = False  # True: each rank holds a slice of every parameter (FSDP)
    sharded = False  # checkpoint format: False = one atomic file, True = DCP directory
    state_file = STATE_FILE  # what --resume looks for in out_dir

    def __init__(self, device: torch.device, activation_checkpointing: bool = False):
        self.device = device
        self.activation_checkpointing = activation_checkpointing
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

    def broadcast_flag(self, flag: bool) -> bool:
        """Rank 0's value of a flag on every rank (e.g. "stop now" after a rank-0 evaluation)."""
        return flag

    @contextlib.contextmanager
    def rank_zero_first(self) -> Iterator[None]:
        """Rank 0 runs the body (train the tokenizer, build shards), then the others, which
        then find its output on the shared file system and reuse it."""
        yield

    def sampler(self, shard: TokenShard, batch_size: int, block_size: int, grad_accum: int,
                seed: int) -> LaneSampler:  # fmt: skip
        """This rank's data lanes [rank*k, (rank+1)*k), k = grad_accum / world_size: all
        grad_accum of them on a single process, so every launch draws the same global batch."""
        k = grad_accum // self.world_size  # micro-batches this rank runs per step
        lanes = range(self.rank * k, (self.rank + 1) * k)
        return LaneSampler(shard, batch_size, block_size, seed, lanes, self.device)

    def full_model(self, model: nn.Module) -> nn.Module | None:
        """The unsharded model on rank 0 (to save in HF layout or sample from); None elsewhere.
        Every rank must call it (FSDP gathers the shards)."""
        return model if self.is_main else None

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole of a parameter (or of optimizer state shaped like one), detached. Every rank
        must call it, in the same order (FSDP all-gathers the slices)."""
        return tensor.detach()

    def shard_like(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full`, laid out as `param` is (the inverse of full_tensor;
        every rank passes the same `full`, no communication)."""
        return full


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
        # experts no token was routed to get no gradient
        moe = getattr(getattr(model, "config", None), "mlp", None) == "moe"
        return nn.parallel.DistributedDataParallel(
            model, device_ids=ids, find_unused_parameters=moe or self.find_unused_parameters,
            static_graph=self.static_graph,
            **({} if self.sync_buffers else {_NO_BUFFER_SYNC: False}),
        )  # fmt: skip

    def no_sync(self, last: bool):
        return contextlib.nullcontext() if last else self.module.no_sync()

    def sum(self, values: list[float]) -> list[float]:
        global _stop_agreed
        t = torch.tensor([*values, float(bool(_stop_requested))], dtype=torch.float64,
                         device=self.device)  # fmt: skip
        dist.all_reduce(t)  # SUM: gloo has no AVG
        *sums, stops = t.tolist()
        # some rank was asked to stop: every rank stops after this step (take_stop)
        _stop_agreed = _stop_agreed or bool(stops)
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

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        tensor = tensor.detach()
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    def shard_like(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if not isinstance(param, DTensor):
            return full
        full = full.to(device=param.device, dtype=param.dtype)
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)

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
    check_world_size(cfg.grad_accum, world, "grad_accum", "micro-batches")
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


# ---- post-training on shards --------------------------------------------------------------------
# Two things break when the trained module is sharded: calls into it must happen inside one
# forward of the sharded root module, whose pre-forward hook gathers the root-level parameters
# (embedding, final norm, head) that `hidden_states` / `lm_head` calls read; and code that needs
# every weight at once (generation with a KV cache, evaluation, export) must not run collectives
# of its own, because ranks would call them different numbers of times (completions of different
# lengths) and wait on each other forever. `LossModule` is that root: any loss function runs as
# its forward. `WholeCopy` is the other half: an unsharded copy of the trained module, refreshed
# from the shards by one gather that every rank joins at the same point, and `swapped_modules`
# points the trainer's attributes (its module, an LM, a rollout engine's policy, a critic) at the
# copy for the length of a block, so evaluation, export and sampling code runs on it unchanged.
#
# The rest is how a global batch and a saved state split over ranks: `EpochSampler` gives each
# rank its slice of the same shuffled order, and the optimizer state is saved with whole tensors
# and re-sliced on load, so one file resumes on any world size and either strategy.


class LossModule(nn.Module):
    """A loss function as the forward of a module holding the trainable parameters: DDP or FSDP
    wraps this, so any loss (two forward passes, a reward head, a regulariser, an RL objective on
    a rollout) is one wrapped call and its gradients are all-reduced (DDP) or reduce-scattered
    (FSDP) in backward, with no change to the code that computes it."""

    def __init__(self, module: nn.Module, config: Any = None):
        super().__init__()
        self.inner = module
        self.config = config  # DDP looks for unused experts in MoE models

    def forward(self, batch: Any, fn: Callable[[Any], Any]) -> Any:
        return fn(batch)


@contextlib.contextmanager
def swapped_modules(owner: object, module: nn.Module, replacement: nn.Module) -> Iterator[None]:
    """For the body, every attribute of `owner` and of the plain objects it holds (an LM, a
    rollout engine) that refers to `module` or one of its submodules refers instead to the
    same-named submodule of `replacement`, a copy with the same structure. This is how
    evaluation, export and sampling code, written against the trainer's own attributes, runs
    unchanged on a whole copy of a sharded model."""
    twin = dict(replacement.named_modules(remove_duplicate=False))
    mapping = {id(m): twin[n] for n, m in module.named_modules(remove_duplicate=False)}
    holders = [owner] + [
        v for v in vars(owner).values()
        if hasattr(v, "__dict__") and not isinstance(v, (nn.Module, torch.Tensor, type))
    ]  # fmt: skip
    changed = []
    for obj in holders:
        for key, value in list(vars(obj).items()):
            if isinstance(value, nn.Module) and id(value) in mapping:
                changed.append((obj, key, value))
                setattr(obj, key, mapping[id(value)])
    try:
        yield
    finally:
        for obj, key, value in changed:
            setattr(obj, key, value)


class WholeCopy:
    """An unsharded copy of a module about to be sharded, kept on the ranks that need whole
    weights (`keep`) and refreshed from the shards when they change.

    `offload` keeps the copy in CPU memory between uses (rank 0's copy for evaluation and
    export, used every few hundred steps); a copy used every step (rollouts) stays on `device`.
    Frozen parameters are copied once here and never gathered again.
    """

    def __init__(self, module: nn.Module, keep: bool, device: torch.device, offload: bool):
        self.device, self.offload = device, offload
        self.copy = copy.deepcopy(module).to("cpu" if offload else device) if keep else None
        self.version: Any = None  # what the copy holds (the trainer's step), None: stale

    @torch.no_grad()
    def refresh(self, module: nn.Module, full_tensor: Callable, version: Any) -> None:
        """Collective: unless the copy already holds `version`, every rank joins the gather of
        `module`'s trainable parameters (one at a time, in the same order on every rank, so the
        peak is one whole parameter beyond the copy) and the keeping ranks write them in."""
        if self.version == version:
            return
        for name, p in module.named_parameters():
            if p.requires_grad:
                whole = full_tensor(p)  # on every rank, keeping or not
                if self.copy is not None:
                    self.copy.get_parameter(name).copy_(whole)
        self.version = version

    @contextlib.contextmanager
    def swapped_in(self, owner: object, module: nn.Module) -> Iterator[None]:
        """For the body, `owner`'s references to `module` point at the copy (on `device`)."""
        try:
            with swapped_modules(owner, module, self.copy.to(self.device)):
                yield
        finally:
            if self.offload:
                self.copy.to("cpu")  # GPU memory holds only the shards between uses


def check_world_size(
    count: int, world_size: int, what: str = "batch_size", unit: str = "examples"
) -> None:
    """The global batch (`count` `unit` of one step) must split evenly over the ranks (checked
    before any step)."""
    if count % world_size:
        raise ConfigError(
            f"{what}={count} is not divisible by the world size {world_size}: it counts the "
            f"{unit} of one step across all ranks (each rank takes {what} / world size); set it "
            f"to a multiple of {world_size}"
        )


class EpochSampler:
    """Shuffled minibatch indices, epoch after epoch; its position is part of the saved state.

    Every rank shuffles the same order and `next()` returns rank `rank`'s contiguous slice of
    the global batch, so the state is the same on every rank and resumes on any world size.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if n < 1:
            raise ConfigError("no training examples")
        self.n, self.batch_size, self.seed = n, min(batch_size, n), seed
        check_world_size(self.batch_size, world_size, f"batch_size (capped at {n} examples)")
        self.rank, self.world_size = rank, world_size
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def next(self) -> list[int]:
        if self.pos + self.batch_size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        share = self.batch_size // self.world_size
        return idx[self.rank * share : (self.rank + 1) * share]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._order = self._shuffle()


def whole_optimizer_state(optimizer: torch.optim.Optimizer, dist: Any) -> dict[str, Any]:
    """optimizer.state_dict() with whole tensors (collective under FSDP, same order on every
    rank), so a saved state does not depend on how the run was split."""
    state = optimizer.state_dict()
    if dist.shards_parameters:
        state["state"] = {
            i: {k: dist.full_tensor(v) if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in sorted(state["state"].items())
        }
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict, dist: Any) -> None:
    """Load a state saved by `whole_optimizer_state`; under FSDP each rank keeps its slice of
    the moments (no communication)."""
    if dist.shards_parameters:
        by_index = [p for g in optimizer.param_groups for p in g["params"]]
        for i, s in state["state"].items():
            p = by_index[int(i)]
            for k, v in s.items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    s[k] = dist.shard_like(v, p)
    optimizer.load_state_dict(state)
