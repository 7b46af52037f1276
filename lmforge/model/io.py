"""Native checkpoints in Hugging Face directory layout: config.json + model.safetensors.

`LM.save` writes this format for lmforge-born models only; a model imported from a transformers
family is written in that family's own layout by lmforge.interop.hf.save_lm (this package must not
import the converters), and lmforge.interop.checkpoint reads both back."""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.errors import CheckpointError
from lmforge.fileio import load_tensors, read_json, save_tensors, write_json
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer

MODEL_TYPE = "lmforge"


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


def load_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig of an lmforge checkpoint directory. Hugging Face and .gguf checkpoints are
    read by lmforge.interop.checkpoint, which sits above this package and calls it for ours."""
    path = Path(directory) / "config.json"
    data = read_config_json(path)
    model_type = data.pop("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not an lmforge checkpoint; load it with "
            "lmforge.interop.checkpoint.load_model (as LM.load and --checkpoint do)"
        )
    return ModelConfig.from_dict(data, source=str(path))


def load_model(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """Build the model from config.json and load weights strictly (every tensor, right shapes).
    lmforge checkpoints only: lmforge.interop.checkpoint.load_model also reads HF and .gguf."""
    directory = Path(directory)
    config = load_config(directory)
    weights_path = directory / "model.safetensors"
    state = load_tensors(weights_path, device)
    with torch.device("meta"):
        model = Transformer(config)
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{weights_path}: does not match config.json "
            f"(missing: {missing[:5] or 'none'}, unexpected: {unexpected[:5] or 'none'})"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{weights_path}: tensor {name} has shape {tuple(tensor.shape)}, "
                f"config.json implies {tuple(expected[name].shape)}"
            )
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=False)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.reset_buffers()
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()
