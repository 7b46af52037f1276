"""Sharded training state with torch.distributed.checkpoint (DCP), and its consolidation.

Every rank writes its own shard of the model and optimizer in parallel; DCP records where each
piece lives, so any number of ranks can read it back (a 2-process run resumes on 1 or 8).
Non-tensor state is JSON: meta.json (step, config; rank 0) and rankN.json (that rank's data
lanes and RNG).

Layout, under out_dir/checkpoints/:
    step_00000040/  __0_0.distcp __1_0.distcp .metadata meta.json rank0.json rank1.json
    latest.json     {"step": 40, "dir": "step_00000040"}
latest.json is replaced atomically only after every rank has finished writing, so a crash
mid-save (a killed rank) leaves the previous complete checkpoint as the one --resume finds.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from lmforge.errors import CheckpointError
from lmforge.fileio import read_json, write_json

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest.json"


def save_sharded(root: str | Path, model, optimizer, meta: dict[str, Any],
                 rank_state: dict[str, Any]) -> Path:  # fmt: skip
    """Collective: write step_<meta['step']> under root and point latest.json at it."""
    root = Path(root)
    rank = dist.get_rank()
    target = root / f"step_{meta['step']:08d}"
    if rank == 0 and target.exists():  # a half-written save of this step from a killed run
        shutil.rmtree(target)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=target)
    write_json(target / f"rank{rank}.json", rank_state)
    if rank == 0:
        write_json(target / "meta.json", {**meta, "world_size": dist.get_world_size()})
    dist.barrier()  # every shard is on disk
    if rank == 0:
        write_json(root / LATEST, {"step": meta["step"], "dir": target.name})
        for old in root.glob("step_*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    return target


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory for an out_dir, its checkpoints/ folder, latest.json or a step dir."""
    path = Path(path)
    if path.is_dir() and (path / CHECKPOINT_DIR).is_dir():
        path = path / CHECKPOINT_DIR
    if path.is_dir() and (path / LATEST).is_file():
        path = path / LATEST
    if path.name == LATEST:
        latest = read_json(path, "sharded checkpoint pointer")
        if not isinstance(latest, dict) or "dir" not in latest:
            raise CheckpointError(f"{path}: field 'dir' missing")
        path = path.parent / latest["dir"]
    if not (path / "meta.json").is_file():
        raise CheckpointError(
            f"no sharded checkpoint at {path} (expected meta.json; give a run's out_dir, its "
            f"{CHECKPOINT_DIR}/ folder or a step_* folder)"
        )
    return path


def check_checkpoint(step_dir: Path) -> dict[str, Any]:
    """meta.json of a complete checkpoint; CheckpointError naming the first missing piece."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = read_json(step_dir / "meta.json", "checkpoint meta")
    for key in ("step", "model_config", "world_size"):
        if key not in meta:
            raise CheckpointError(f"{step_dir / 'meta.json'}: field {key!r} missing")
    try:
        metadata = FileSystemReader(str(step_dir)).read_metadata()
    except (OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{step_dir}: no readable DCP .metadata ({err})") from err
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(sizes.items()):
        shard = step_dir / name
        if not shard.is_file():
            raise CheckpointError(
                f"missing shard {shard}: this checkpoint was saved by {meta['world_size']} ranks "
                "and is incomplete; restore the file or resume from an earlier checkpoint"
            )
        if shard.stat().st_size < size:
            raise CheckpointError(f"truncated shard {shard}: {shard.stat().st_size} < {size} bytes")
    for rank in range(meta["world_size"]):
        if not (step_dir / f"rank{rank}.json").is_file():
            raise CheckpointError(f"missing per-rank state {step_dir / f'rank{rank}.json'}")
    return meta


def read_rank_states(step_dir: Path, world_size: int) -> list[dict[str, Any]]:
    return [read_json(step_dir / f"rank{r}.json", "per-rank state") for r in range(world_size)]


def load_sharded(step_dir: Path, model, optimizer) -> None:
    """Collective: fill model and optimizer (sharded or replicated, any world size) in place."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        dcp.load(state, checkpoint_id=step_dir)
    except Exception as err:  # DCP wraps per-rank failures in its own exception types
        raise CheckpointError(f"{step_dir}: could not load the sharded state ({err})") from err
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


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
    state = {"model": get_model_state_dict(model)}
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": yes, intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=step_dir, no_dist=not dist.is_initialized())
    except Exception as err:
        raise CheckpointError(f"{step_dir}: could not load the model shards ({err})") from err
    set_model_state_dict(model, state["model"])
    tokenizer = Tokenizer.load(run_dir) if (run_dir / "tokenizer.json").is_file() else None
    out = Path(out_dir) if out_dir is not None else run_dir
    LM(model, tokenizer).save(out)
    return out / "model.safetensors"


def rng_json() -> dict[str, list[int]]:
    """This rank's RNG states as JSON-safe byte lists (dropout masks continue exactly)."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_json(state: dict[str, list[int]]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
