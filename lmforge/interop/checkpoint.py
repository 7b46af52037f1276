"""Load a model checkpoint in any format lmforge reads, by looking at what the path holds:

    a .gguf file                          llama.cpp / Ollama (gguf.py; dense here, LM.load
                                          runs it at its own precision)
    a directory, config.json model_type   "lmforge" or absent: our own format (lmforge.model.io)
                                          anything else: a Hugging Face checkpoint (hf.py)

This dispatch lives here, above lmforge.model, because the model package must not import the
converters (tests/test_imports.py): lmforge.model.io reads and writes only lmforge's own format.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.interop.gguf import gguf_config
from lmforge.interop.hf import hf_config_to_ours, load_hf_model
from lmforge.model import io as native
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer


def _foreign_model_type(config_path: Path) -> str | None:
    """The Hugging Face model_type of a checkpoint's config.json (None: one of ours)."""
    model_type = native.read_config_json(config_path).get("model_type")
    return None if model_type in (None, native.MODEL_TYPE) else model_type


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint: ours, a Hugging Face directory or a .gguf file."""
    path = Path(path)
    if path.is_file():
        return gguf_config(path)
    config_path = path / "config.json"
    if _foreign_model_type(config_path) is not None:
        return hf_config_to_ours(native.read_config_json(config_path), str(config_path))
    return native.load_lmforge_config(path)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """The model of a checkpoint (ours, Hugging Face or .gguf), weights loaded strictly."""
    path = Path(path)
    if path.is_file():
        from lmforge.interop.gguf import load_gguf

        return load_gguf(path, device, dtype or torch.float32)[0]  # dense: trainable weights
    if _foreign_model_type(path / "config.json") is not None:
        return load_hf_model(path, device, dtype)
    return native.load_lmforge_model(path, device, dtype)
