"""Sharded training state in safetensors + JSON (reading it runs no code), and its consolidation.

Every rank writes its own slice of the model and optimizer in parallel; each slice records where
it sits in the whole tensor, so any number of ranks can read it back (a 2-process run resumes on
1 or 8, and one process consolidates it). Nothing here is a pickle: torch.distributed.checkpoint's
`.metadata` is one, and unpickling a file from disk runs whatever code it names.

Layout, under out_dir/checkpoints/:
    step_00000040/
        meta.json            rank 0: format, step, config, world size, the global shape and
                             dtype of every tensor, tied names, the non-tensor optimizer values
        rank0.safetensors    rank 0's slices; header metadata "offsets": {name: [global offset]}
        rank0.json           rank 0's data lanes and RNG
        rank1.safetensors rank1.json ...
    latest.json     {"step": 40, "dir": "step_00000040"}
A tensor replicated over ranks (DDP, a replicated DTensor dim) is written once, by the lowest
coordinate; a DTensor shard by the rank that holds it. latest.json is replaced atomically only
after every rank has finished writing, so a crash mid-save (a killed rank) leaves the previous
complete checkpoint as the one --resume finds.
"""

from __future__ import annotations

import json
import math
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open

from lmforge.errors import CheckpointError
from lmforge.fileio import read_json, remove_stale_temps, save_tensors, write_json
from lmforge.train.checkpoint import fill_skeleton, state_skeleton

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest.json"
FORMAT = "lmforge-sharded-safetensors/1"
# The dtypes a checkpoint may name (a name outside this table is refused, never looked up), each
# with safetensors' name for it (what a shard's header reports).
ST_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
            "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
            "bool": "BOOL"}  # fmt: skip
_OLD_FORMAT = (
    "was written by an older lmforge in torch.distributed.checkpoint format, whose .metadata is "
    "a pickle and cannot be read safely; start a new out_dir, or consolidate it with the lmforge "
    "version that wrote it if you trust its origin"
)


# ---- tensors and where they sit --------------------------------------------------------------
def _tied_names(model: torch.nn.Module, names: set[str]) -> dict[str, str]:
    """{name: canonical name} for state-dict entries that are the same parameter or buffer object
    as an earlier one (tied embeddings); the same on every rank, whatever its slice holds."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    members = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]  # fmt: skip
    for name, tensor in members:
        key = f"model.{name}"
        if key in names and (canonical := first.setdefault(id(tensor), key)) != key:
            tied[key] = canonical
    return tied


def _local_slice(tensor: torch.Tensor, rank: int) -> tuple[torch.Tensor, list[int], bool]:
    """(this rank's data, its global offset, whether this rank is the one to write it) for a
    DTensor's local shard or a plain (replicated) tensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, [0] * tensor.dim(), rank == 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(p.is_partial() for p in tensor.placements):
        raise CheckpointError("cannot checkpoint a DTensor with a Partial placement")
    _, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    coord = tensor.device_mesh.get_coordinate() or []
    # a dim replicated over the mesh: every coordinate holds the same data; the first writes
    owner = all(c == 0 for c, p in zip(coord, tensor.placements) if p.is_replicate())
    return tensor.to_local(), list(offset), owner


# ---- save --------------------------------------------------------------------------------------
def save_sharded(root: str | Path, model, optimizer, meta: dict[str, Any],
                 rank_state: dict[str, Any]) -> Path:  # fmt: skip
    """Collective (also works in one process without a process group): write
    step_<meta['step']> under root and point latest.json at it."""
    root = Path(root)
    group = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if group else (0, 1)
    target = root / f"step_{meta['step']:08d}"
    remove_stale_temps(root)  # orphans of saves killed before the rename (every rank: its host)
    if rank == 0 and target.exists():  # a half-written save of this step from a killed run
        shutil.rmtree(target)
    if group:
        dist.barrier()
    from torch.distributed.checkpoint.state_dict import get_state_dict  # slow to import

    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = state_skeleton({"model": model_sd, "optimizer": optim_sd}, "", tensors, str(target))
    tied = _tied_names(model, set(tensors))
    slices: dict[str, torch.Tensor] = {}
    offsets: dict[str, list[int]] = {}
    seen: set[tuple] = set()
    for name, tensor in tensors.items():  # nothing is written before every dtype is checked
        if str(tensor.dtype).removeprefix("torch.") not in ST_NAMES:
            raise CheckpointError(f"{target}: {name} has dtype {tensor.dtype}, not storable")
        if name in tied:
            continue
        local, offset, owner = _local_slice(tensor.detach(), rank)
        if not owner or local.numel() == 0:  # an empty slice adds nothing to read back
            continue
        data = local.cpu().contiguous()
        # safetensors refuses two names on one storage; an untied alias is copied
        ident = (data.data_ptr(), data.dtype, tuple(data.shape))
        if ident in seen:
            data = data.clone()
        seen.add(ident)
        slices[name], offsets[name] = data, offset
    save_tensors(target / f"rank{rank}.safetensors", slices,
                 metadata={"format": FORMAT, "offsets": json.dumps(offsets)})  # fmt: skip
    write_json(target / f"rank{rank}.json", rank_state)
    if rank == 0:
        shapes = {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                  for name, t in tensors.items() if name not in tied}  # fmt: skip
        write_json(target / "meta.json", {
            **meta, "format": FORMAT, "world_size": world, "tensors": shapes, "tied": tied,
            "state": skeleton,
        })  # fmt: skip
    if group:
        dist.barrier()  # every shard is on disk
    if rank == 0:
        write_json(root / LATEST, {"step": meta["step"], "dir": target.name})
        for old in root.glob("step_*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    return target


# ---- find and check ----------------------------------------------------------------------------
def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory for an out_dir, its checkpoints/ folder, latest.json or a step dir."""
    path = Path(path)
    if path.is_dir() and (path / CHECKPOINT_DIR).is_dir():
        path = path / CHECKPOINT_DIR
    if path.is_dir() and (path / LATEST).is_file():
        path = path / LATEST
    if path.name == LATEST:
        latest = read_json(path, "sharded checkpoint pointer")
        step = latest.get("dir") if isinstance(latest, dict) else None
        if not (isinstance(step, str) and step.startswith("step_") and Path(step).name == step):
            raise CheckpointError(f"{path}: 'dir' must name a step_* folder beside it")
        path = path.parent / step
    if not (path / "meta.json").is_file():
        if path.is_dir() and (path / ".metadata").is_file():
            raise CheckpointError(f"{path} {_OLD_FORMAT}")
        raise CheckpointError(
            f"no sharded checkpoint at {path} (expected meta.json; give a run's out_dir, its "
            f"{CHECKPOINT_DIR}/ folder or a step_* folder)"
        )
    return path


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def _check_meta(step_dir: Path) -> dict[str, Any]:
    where = step_dir / "meta.json"
    meta = read_json(where, "checkpoint meta")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: expected a JSON object")
    if meta.get("format") != FORMAT:
        if (step_dir / ".metadata").exists() or any(step_dir.glob("*.distcp")):
            raise CheckpointError(f"{step_dir} {_OLD_FORMAT}")
        raise CheckpointError(f"{where}: format is {meta.get('format')!r}, expected {FORMAT!r}")
    for key, kind in (("step", int), ("model_config", dict), ("world_size", int),
                      ("tensors", dict), ("tied", dict), ("state", dict)):  # fmt: skip
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise CheckpointError(f"{where}: field {key!r} missing or not a {kind.__name__}")
    if meta["world_size"] < 1:
        raise CheckpointError(f"{where}: world_size must be >= 1, got {meta['world_size']}")
    for name, info in meta["tensors"].items():
        if not (isinstance(info, dict) and _int_list(info.get("shape"))
                and info.get("dtype") in ST_NAMES):  # fmt: skip
            raise CheckpointError(f"{where}: tensor {name!r} needs a shape and a known dtype")
    for alias, name in meta["tied"].items():
        if name not in meta["tensors"]:
            raise CheckpointError(f"{where}: tied name {alias!r} points to unknown {name!r}")
    return meta


class _Chunks:
    """Where every saved slice lives: name -> [(rank file index, global offset, shape)], read
    from the safetensors headers (parsed by the safetensors library, no code)."""

    def __init__(self, step_dir: Path, meta: dict[str, Any]):
        self.step_dir, self.meta = step_dir, meta
        self.files = [step_dir / f"rank{r}.safetensors" for r in range(meta["world_size"])]
        self.chunks: dict[str, list[tuple[int, list[int], list[int]]]] = {}
        for index, path in enumerate(self.files):
            if not path.is_file():
                raise CheckpointError(
                    f"missing shard {path}: this checkpoint was saved by {meta['world_size']} "
                    "ranks and is incomplete; restore the file or resume from an earlier checkpoint"
                )
            try:
                with safe_open(str(path), framework="pt") as fh:
                    header = fh.metadata() or {}
                    shapes = {k: (list(fh.get_slice(k).get_shape()), fh.get_slice(k).get_dtype())
                              for k in fh.keys()}  # fmt: skip
            except (SafetensorError, OSError, ValueError, RuntimeError) as err:
                raise CheckpointError(f"{path}: corrupt or truncated shard ({err})") from err
            if header.get("format") != FORMAT:
                raise CheckpointError(f"{path}: not a {FORMAT} shard")
            try:
                offsets = json.loads(header.get("offsets", ""))
            except json.JSONDecodeError as err:
                raise CheckpointError(f"{path}: invalid 'offsets' metadata ({err})") from err
            if not isinstance(offsets, dict) or set(offsets) != set(shapes):
                raise CheckpointError(f"{path}: 'offsets' do not list the file's tensors")
            for name, (shape, dtype) in shapes.items():
                self._add(path, index, name, offsets[name], shape, dtype)
        for name, info in meta["tensors"].items():
            covered = sum(math.prod(c[2]) for c in self.chunks.get(name, []))
            if covered != math.prod(info["shape"]):
                raise CheckpointError(
                    f"{step_dir}: tensor {name!r} has {covered} of {math.prod(info['shape'])} "
                    "elements in the shards (a shard is missing or from another save)"
                )

    def _add(self, path: Path, index: int, name: str, offset: Any, shape: list[int],
             dtype: str) -> None:  # fmt: skip
        info = self.meta["tensors"].get(name)
        if info is None:
            raise CheckpointError(f"{path}: tensor {name!r} is not in meta.json")
        full = info["shape"]
        if not _int_list(offset) or len(offset) != len(full) or len(shape) != len(full):
            raise CheckpointError(f"{path}: tensor {name!r} has a bad offset {offset!r}")
        if any(o + s > f for o, s, f in zip(offset, shape, full)):
            raise CheckpointError(f"{path}: slice of {name!r} lies outside its shape {full}")
        if ST_NAMES[info["dtype"]] != dtype:
            raise CheckpointError(f"{path}: {name!r} is {dtype}, meta.json says {info['dtype']}")
        self.chunks.setdefault(name, []).append((index, offset, shape))

    def fill(self, name: str, out: torch.Tensor, offset: list[int], handles: list) -> None:
        """Copy the region [offset, offset + out.shape) of saved tensor `name` into out."""
        name = self.meta["tied"].get(name, name)
        if name not in self.meta["tensors"]:
            raise CheckpointError(f"{self.step_dir}: tensor {name!r} is not in the checkpoint")
        full = self.meta["tensors"][name]["shape"]
        if len(full) != len(offset) or any(
            o + s > f for o, s, f in zip(offset, out.shape, full)
        ):  # fmt: skip
            raise CheckpointError(
                f"{self.step_dir}: {name!r} has shape {full}, this model needs "
                f"{list(out.shape)} at offset {offset}"
            )
        filled = 0
        for index, c_off, c_shape in self.chunks.get(name, []):
            lo = [max(a, b) for a, b in zip(c_off, offset)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(c_off, c_shape, offset, out.shape)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):  # no overlap (a 0-dim one always has)
                continue
            src = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, c_off))
            part = handles[index].get_slice(name)[src]  # [()]: a 0-dim tensor whole
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offset))
            out[dst].copy_(part)
            filled += part.numel()
        if filled != out.numel():
            raise CheckpointError(f"{self.step_dir}: the shards do not cover all of {name!r}")


def check_checkpoint(step_dir: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint, after checking every shard's header (present, not
    truncated, consistent with meta.json); CheckpointError naming the first problem.
    Reads JSON and safetensors headers only: a checkpoint in the old pickle format is refused."""
    meta = _check_meta(step_dir)
    _Chunks(step_dir, meta)
    read_rank_states(step_dir, meta["world_size"])  # present and readable: a complete checkpoint
    return meta


def read_rank_states(step_dir: Path, world_size: int) -> list[dict[str, Any]]:
    """Every saving rank's rankN.json: {"sampler": {"lanes": {...}}, "rng": {...}} (the data
    lanes and RNG that DDPParallel.save_state writes), checked to have that shape."""
    states = [read_json(step_dir / f"rank{r}.json", "per-rank state") for r in range(world_size)]
    for r, state in enumerate(states):
        ok = isinstance(state, dict) and isinstance(state.get("rng"), dict)
        if not (ok and isinstance(state.get("sampler"), dict)
                and isinstance(state["sampler"].get("lanes"), dict)):  # fmt: skip
            raise CheckpointError(
                f"{step_dir / f'rank{r}.json'}: expected an object with 'sampler.lanes' and 'rng'"
            )
    return states


# ---- load --------------------------------------------------------------------------------------
def _fill(step_dir: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Fill every tensor (plain, or this rank's shard of a DTensor) from the saved slices."""
    chunks = _Chunks(step_dir, meta)
    with ExitStack() as stack, torch.no_grad():
        try:
            handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in chunks.files]
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{step_dir}: cannot open the shards ({err})") from err
        for name, tensor in tensors.items():
            local, offset, _ = _local_slice(tensor, 0)
            if local.numel() == 0 and local.dim():
                continue
            # a device tensor is read on the host, then copied to the device in one go
            on_cpu = local.device.type == "cpu"
            host = local if on_cpu else torch.empty(local.shape, dtype=local.dtype)
            chunks.fill(name, host, offset, handles)
            if not on_cpu:
                local.copy_(host)


def load_sharded(step_dir: Path, model, optimizer) -> None:
    """Collective (or one process): fill model and optimizer (sharded or replicated, any world
    size) in place from a checked checkpoint. Each rank reads only the parts of each saved slice
    that overlap its own shard."""
    step_dir = Path(step_dir)
    remove_stale_temps(step_dir.parent)  # resuming reopens checkpoints/ for writing
    meta = _check_meta(step_dir)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    state_skeleton({"model": model_sd, "optimizer": optim_sd}, "", tensors, str(step_dir))
    if missing := sorted(set(tensors) - set(meta["tensors"]) - set(meta["tied"])):
        raise CheckpointError(
            f"{step_dir}: no saved state for {missing[0]!r} ({len(missing)} missing); it was "
            "written for another model or optimizer"
        )
    _fill(step_dir, meta, tensors)
    # the non-tensor values (param groups: lr, betas, ...) come from the checkpoint; tensors
    # are the ones just filled
    state = fill_skeleton(meta["state"], tensors, str(step_dir))
    if not (isinstance(state.get("model"), dict) and isinstance(state.get("optimizer"), dict)):
        raise CheckpointError(f"{step_dir / 'meta.json'}: 'state' needs model and optimizer")
    try:  # the model's own state dict, filled in place (its keys are this model's)
        set_state_dict(model, optimizer, model_state_dict=model_sd,
                       optim_state_dict=state["optimizer"])  # fmt: skip
    except (KeyError, ValueError, RuntimeError, TypeError) as err:
        raise CheckpointError(
            f"{step_dir}: the saved optimizer state does not fit ({err})"
        ) from err


def consolidate(path: str | Path, out_dir: str | Path | None = None) -> Path:
    """Read a sharded checkpoint in this one process and write the HF directory layout
    (config.json, model.safetensors, tokenizer files) to out_dir (default: the run's out_dir).
    Needs no process group; memory: one full copy of the weights (no optimizer state)."""
    from lmforge.lm import LM
    from lmforge.model.config import ModelConfig
    from lmforge.model.transformer import Transformer
    from lmforge.tokenizer import Tokenizer

    step_dir = resolve_checkpoint(path)
    meta = check_checkpoint(step_dir)
    run_dir = step_dir.parent.parent
    model = Transformer(ModelConfig.from_dict(meta["model_config"], source=str(step_dir)))
    # the state dict shares storage with the parameters: they are filled in place
    _fill(step_dir, meta, {f"model.{k}": v for k, v in model.state_dict().items()})
    tokenizer = Tokenizer.load(run_dir) if (run_dir / "tokenizer.json").is_file() else None
    out = Path(out_dir) if out_dir is not None else run_dir
    LM(model, tokenizer).save(out)
    return out / "model.safetensors"
