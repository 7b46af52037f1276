"""Write a Llama-architecture LM as a llama.cpp GGUF file (runs in llama.cpp / Ollama).

Our model -> HF-named tensors (lmforge.interop.hf.export_state, which also turns interleaved RoPE
into rotate-half) -> GGUF names (gguf's TensorNameMap) with llama.cpp's q/k row permutation for its
interleaved RoPE, the way llama.cpp's convert_hf_to_gguf.py writes a Llama. Weights are stored as
F16, BF16 or Q8_0 (`gguf.quants.quantize`); 1-D tensors (norms, biases) stay F32 as llama.cpp
expects. The tokenizer (byte-level BPE) and chat template go into the metadata. The model and
tokenizer are checked before the file is opened, and the file appears only when complete.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lmforge.errors import ConfigError, require_choice
from lmforge.fileio import atomic_write
from lmforge.interop.families import FAMILIES, Llama
from lmforge.interop.gguf_read import gguf_names, permute_named
from lmforge.interop.gguf_tokenizer import tokenizer_to_gguf
from lmforge.interop.hf import export_state, require_dense
from lmforge.interop.rope import rope_to_hf
from lmforge.model.config import ModelConfig
from lmforge.model.positions import rope_inv_freq, rope_scaling_type

EXPORT_DTYPES = ("f16", "bf16", "q8_0")


class LlamaCpp(Llama):
    """What llama.cpp's "llama" architecture runs right: a plain pre-norm SwiGLU Llama block."""

    needs = {**Llama.needs, "mlp": ("swiglu",), "mlp_bias": (False,)}

    def export_problems(self, config: ModelConfig) -> list[str]:
        problems = super().export_problems(config)
        kind = rope_scaling_type(config.rope_scaling)
        if kind not in ("default", "linear", "yarn", "llama3", "ntk"):
            problems.append(f"rope_scaling {kind!r} (llama.cpp has default, linear, yarn, llama3)")
        return problems


def _rope_metadata(writer, config: ModelConfig) -> np.ndarray | None:
    """Write the RoPE keys; returns Llama 3's per-frequency divisors (the rope_freqs tensor)."""
    import gguf

    scaling = config.rope_scaling or {}
    kind = rope_scaling_type(config.rope_scaling)
    base = rope_to_hf(config)["rope_theta"]  # static NTK: plain RoPE with a larger base
    writer.add_rope_freq_base(float(base))
    if kind in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType[kind.upper()])
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    if kind == "yarn":
        writer.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        for beta in ("beta_fast", "beta_slow"):
            if scaling.get(beta) is not None:
                getattr(writer, f"add_rope_scaling_yarn_{beta}")(float(scaling[beta]))
    elif kind == "llama3":  # llama.cpp divides each frequency by a stored factor
        d = config.head_dim
        plain = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        scaled = rope_inv_freq(d, base, config.rope_scaling)[0].double()
        return (plain / scaled).float().numpy()
    return None


def _store(name: str, tensor: torch.Tensor, dtype: str):
    """(array, ggml type) for one tensor: 1-D stays F32; Q8_0 needs rows in 32-blocks."""
    import gguf
    from gguf.quants import quantize

    Q = gguf.GGMLQuantizationType
    data = tensor.detach().to(torch.float32).cpu().numpy()
    if data.ndim == 1:
        return data, Q.F32
    if dtype == "q8_0" and data.shape[-1] % 32 == 0:
        return quantize(data, Q.Q8_0), Q.Q8_0
    if dtype == "bf16":
        return quantize(data, Q.BF16), Q.BF16
    return data.astype(np.float16), Q.F16  # f16, and Q8_0 rows not made of 32-blocks


def export_gguf(lm, path: str | Path, dtype: str = "f16") -> Path:
    """Write `lm` (a llama-architecture model and its byte-level BPE tokenizer) as GGUF."""
    import gguf

    path = Path(path)
    require_choice("GGUF dtype", dtype, EXPORT_DTYPES)
    model, tok = lm.model, lm.tokenizer
    require_dense(model, "export")
    config = model.config
    if problems := LlamaCpp().export_problems(config):
        raise ConfigError(
            f"this model cannot be written as a llama.cpp 'llama' GGUF: {'; '.join(problems)}"
        )
    if tok is None:
        raise ConfigError("GGUF export needs the model's tokenizer (llama.cpp reads it from there)")
    vocab_meta = tokenizer_to_gguf(tok, config.vocab_size)

    hf_state = export_state(FAMILIES["llama"], model)
    tensors = [
        (name, permute_named(name, hf_state[hf_name], config))
        for hf_name, name in gguf_names("llama", config.n_layer, hf_state).items()
    ]

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, arch="llama")
        writer.add_name(str(config.extra.get("name") or path.stem))
        writer.add_context_length(config.max_seq_len)
        writer.add_embedding_length(config.d_model)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(config.d_ff)
        writer.add_head_count(config.n_head)
        writer.add_head_count_kv(config.n_kv_head)
        writer.add_rope_dimension_count(config.head_dim)
        if config.head_dim * config.n_head != config.d_model:
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
        writer.add_layer_norm_rms_eps(float(config.norm_eps))
        writer.add_vocab_size(config.vocab_size)
        writer.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{dtype.upper()}"))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        rope_freqs = _rope_metadata(writer, config)
        for name, value in vocab_meta.items():
            getattr(writer, f"add_{name}")(value)
        if rope_freqs is not None:
            writer.add_tensor("rope_freqs.weight", rope_freqs)
        for name, tensor in tensors:
            data, qtype = _store(name, tensor, dtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write(path, write)  # the file appears only when complete
    return path
