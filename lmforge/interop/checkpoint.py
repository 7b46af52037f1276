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


def _hf_config(config_path: Path) -> dict | None:
    """A checkpoint's config.json when it is a Hugging Face one (None: one of ours)."""
    data = native.read_config_json(config_path)
    return None if data.get("model_type") in (None, native.MODEL_TYPE) else data


def load_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint: ours, a Hugging Face directory or a .gguf file."""
    path = Path(path)
    if path.is_file():
        return gguf_config(path)
    if (hf := _hf_config(path / "config.json")) is not None:
        return hf_config_to_ours(hf, str(path / "config.json"))
    return native.load_lmforge_config(path)


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Transformer:
    """The model of a checkpoint (ours, Hugging Face or .gguf), weights loaded strictly."""
    path = Path(path)
    if path.is_file():
        from lmforge.interop.gguf import load_gguf

        return load_gguf(path, device, dtype or torch.float32)[0]  # dense: trainable weights
    if _hf_config(path / "config.json") is not None:
        return load_hf_model(path, device, dtype)
    return native.load_lmforge_model(path, device, dtype)
