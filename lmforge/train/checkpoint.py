"""Resumable training state in ONE safetensors file, so a crash can never leave half a checkpoint.

The file holds the model weights, the optimizer moments and the RNG states as tensors, and every
non-tensor value (iteration, optimizer hyper-parameters, data position, config) as JSON in the
safetensors metadata. It is written to a temp file and renamed into place; saving and resuming
first remove the temp files that killed saves left in the folder (fileio.remove_stale_temps).
The optimizer state is saved with whole tensors and re-sliced on load (`whole_optimizer_state`),
so one file resumes on any world size and strategy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lmforge.errors import CheckpointError
from lmforge.fileio import load_tensors, remove_stale_temps, save_tensors

STATE_FILE = "training_state.safetensors"


def state_skeleton(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """A JSON-safe copy of a nested state with every tensor replaced by {"__tensor__": name},
    collecting the tensors by name (the dotted path, e.g. model.embed.weight). Tuples stay
    tuples (AdamW's betas); dict keys become strings (optimizer state indices)."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    dot = f"{prefix}." if prefix else ""
    if isinstance(obj, dict):
        return {str(k): state_skeleton(v, f"{dot}{k}", tensors, where) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {"__tuple__": [state_skeleton(v, f"{dot}{i}", tensors, where)
                              for i, v in enumerate(obj)]}  # fmt: skip
    if isinstance(obj, list):
        return [state_skeleton(v, f"{dot}{i}", tensors, where) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise CheckpointError(f"{where}: cannot store {type(obj).__name__} at {prefix!r} as JSON")


def fill_skeleton(obj: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The nested state a `state_skeleton` stands for, its tensors taken from `tensors`."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            if obj["__tensor__"] not in tensors:
                raise CheckpointError(f"{where}: unknown tensor {obj['__tensor__']!r}")
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__tuple__"} and isinstance(obj["__tuple__"], list):
            return tuple(fill_skeleton(v, tensors, where) for v in obj["__tuple__"])
        return {k: fill_skeleton(v, tensors, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [fill_skeleton(v, tensors, where) for v in obj]
    return obj


def save_training_state(path: str | Path, state: dict[str, Any]) -> None:
    """Save a nested dict of tensors and JSON-able values atomically."""
    remove_stale_temps(Path(path).parent)  # full-size orphans of earlier saves that were killed
    tensors: dict[str, torch.Tensor] = {}
    skeleton = state_skeleton(state, "s", tensors, str(path))
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_tensors(path, tensors, metadata={"lmforge_state": json.dumps(skeleton)})


def load_training_state(path: str | Path) -> dict[str, Any]:
    """The state saved by save_training_state, for --resume (which reopens path's folder for
    writing, so the orphaned temp files of killed saves are removed from it first)."""
    path = Path(path)
    remove_stale_temps(path.parent)
    tensors = load_tensors(path)
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    if "lmforge_state" not in meta:
        raise CheckpointError(f"{path}: not an lmforge training state (no metadata)")
    try:
        state = fill_skeleton(json.loads(meta["lmforge_state"]), tensors, str(path))
        if not isinstance(state, dict):
            raise TypeError("expected a JSON object")
        # JSON turns int dict keys (optimizer state indices) into strings; restore them.
        if isinstance(optim := state.get("optimizer"), dict) and "state" in optim:
            optim["state"] = {int(k): v for k, v in optim["state"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # incl. JSONDecodeError
        raise CheckpointError(f"{path}: malformed lmforge_state metadata ({err})") from err
    return state


def check_signature(where: str | Path, saved: Any, current: dict[str, Any]) -> None:
    """CheckpointError naming the differing keys unless a resumed state was saved with the
    same model settings (`Trainer.signature`, compared as JSON) as this run."""
    current = json.loads(json.dumps(current))  # tuples as lists, keys as strings: as saved
    if saved != current:
        saved = saved if isinstance(saved, dict) else {}
        diff = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
        raise CheckpointError(
            f"{where}: saved with a different model config (differs in: {', '.join(diff)}); "
            "start a new out_dir or restore the original settings"
        )


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without tied duplicates (safetensors refuses shared storage)."""
    state = model.state_dict()
    seen: set[int] = set()
    for name, tensor in list(state.items()):
        if tensor.data_ptr() in seen and tensor.numel() > 0:
            del state[name]
        seen.add(tensor.data_ptr())
    return state


def rng_state(json_safe: bool = False) -> dict[str, Any]:
    """This process's RNG states (CPU, and CUDA once used), so dropout masks continue exactly
    on resume; `json_safe`: as byte lists (a sharded checkpoint's per-rank JSON)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return {k: v.tolist() for k, v in state.items()} if json_safe else state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states of `rng_state` (tensors or byte lists); malformed: CheckpointError."""
    try:
        torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.as_tensor(state["cuda"], dtype=torch.uint8))
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"the saved RNG state is malformed ({err})") from err


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
