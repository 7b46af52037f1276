"""Native checkpoints in Hugging Face directory layout: config.json + model.safetensors.

`LM.save` writes this format for lmforge-born models only; a model imported from a transformers
family is written in that family's own layout by lmforge.interop.hf.save_lm (this package must not
import the converters), and lmforge.interop.checkpoint reads both back."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lmforge.errors import CheckpointError
from lmforge.fileio import (
    check_safetensors_header,
    check_state,
    load_tensors,
    read_json,
    save_tensors,
    write_json,
)
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer

MODEL_TYPE = "lmforge"
INDEX_FILE = "model.safetensors.index.json"  # Hugging Face's shard index


def save_model(model: Transformer, directory: str | Path) -> None:
    """Write config.json and model.safetensors (tied weights stored once)."""
    directory = Path(directory)
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    save_tensors(directory / "model.safetensors", state, metadata={"format": "pt"})
    write_json(directory / "config.json", {"model_type": MODEL_TYPE, **model.config.to_dict()})


def read_config_json(path: Path) -> dict:
    """A checkpoint's config.json, which must hold a JSON object (CheckpointError if not)."""
    data = read_json(path, "model config")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object of config fields, got a "
                              f"{type(data).__name__}")  # fmt: skip
    return data


def load_lmforge_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of an lmforge checkpoint directory. Hugging Face and .gguf checkpoints are
    read by lmforge.interop.checkpoint, which sits above this package and calls it for ours."""
    path = Path(directory) / "config.json"
    data = read_config_json(path)
    if (model_type := data.pop("model_type", MODEL_TYPE)) != MODEL_TYPE:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not an lmforge checkpoint; load it with "
            "lmforge.interop.checkpoint.load_model (as LM.load and --checkpoint do)"
        )
    return ModelConfig.from_dict(data, source=str(path))


def load_lmforge_model(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """Build the model from config.json and load weights strictly (every tensor, right shapes).
    lmforge checkpoints only: lmforge.interop.checkpoint.load_model also reads HF and .gguf."""
    directory = Path(directory)
    config = load_lmforge_config(directory)
    weights_path = directory / "model.safetensors"
    state = load_tensors(weights_path, device)
    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    check_state(weights_path, state, expected)
    return build_model(config, state, device, dtype)


def build_model(
    config: ModelConfig, state: dict[str, torch.Tensor], device="cpu", dtype=None
) -> Transformer:
    """Materialise a Transformer from a checked state dict (ours, or converted from an HF folder
    or a GGUF file): built on the meta device, so no random init is spent on weights about to be
    replaced. Buffers (rope tables, fixed scales) are not in the state dict: they are refilled.
    dtype None keeps the state's own."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=False)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_buffers()
    return (model if dtype is None else model.to(dtype)).eval()


def weight_files(directory: Path) -> dict[str, Path]:
    """tensor name -> file holding it, from the shard index or the single safetensors file."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map'")
        files = {name: directory / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index}: shard {shard.name} is missing from {directory}")
        return files
    single = directory / "model.safetensors"
    if not single.is_file():
        # A pickled pytorch_model.bin is never read: unpickling can run code from the file (and
        # torch's restricted loader is still an unpickler).
        found = sorted(p.name for p in directory.glob("*.bin")) or "no weights"
        raise CheckpointError(
            f"{directory}: no model.safetensors or {INDEX_FILE} (found: {found}); only safetensors "
            "checkpoints are read: convert pickled weights, e.g. with transformers "
            "AutoModel.from_pretrained(DIR).save_pretrained(DIR)"
        )
    names = check_safetensors_header(single).keys() - {"__metadata__"}
    return dict.fromkeys(sorted(names), single)


def read_tensors(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Read only `names`, opening each shard once."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    out = {}
    for path, keys in by_file.items():
        check_safetensors_header(path)
        try:
            with safe_open(str(path), "pt") as f:
                out.update({key: f.get_tensor(key) for key in keys})
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path}: corrupt safetensors file ({err})") from err
    return out
