"""Read a llama.cpp GGUF file into our Transformer: GGUF -> HF-style config + tensors -> ours.

The metadata becomes a Hugging Face config dict, which the existing family table
(lmforge.interop.families) turns into a ModelConfig; the family's key map names every tensor our
model needs in HF terms, and gguf's own TensorNameMap gives each one's GGUF name. So this module
knows only what GGUF does differently from an HF checkpoint:

- names (`blk.N.attn_q.weight`) and the metadata keys (`llama.rope.freq_base`, ...);
- llama.cpp permutes the q/k rows of the llama architecture (Llama, Mistral, SmolLM2) so that its
  interleaved-pair RoPE computes HF's rotate-half RoPE; we undo it (transformers' reverse_permute);
- quantised tensors: Q8_0 and Q4_0 / Q4_1 blocks are read as they are stored (`read_q4_blocks`,
  `read_q8_blocks`) for the kernels that run those formats; every type can be
  dequantised with `gguf.quants.dequantize` (`GGUFFile.read`);
- GPT-2's projections are stored [out, in] (already our layout, no Conv1D transpose);
- Llama 3.x stores its RoPE scaling as a `rope_freqs` tensor of per-frequency divisors, which is
  matched back to HF's "llama3" rope_scaling (and rejected if it is not of that form).

Everything (the header's fields and bounds: gguf_header.py; architecture, tensor types, every
tensor's name and shape: `check_tensors`) is checked before any tensor is read, so bad input
costs one CheckpointError and no half-built model. lmforge.interop.gguf_load builds the model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge.errors import CheckpointError, ConfigError, LMForgeError
from lmforge.fileio import check_state
from lmforge.interop.families import FAMILIES, Family
from lmforge.interop.gguf_header import GGUFHeader
from lmforge.interop.hf import hf_config_to_ours, hf_shapes
from lmforge.model.config import ModelConfig
from lmforge.model.positions import rope_inv_freq
from lmforge.model.transformer import Transformer

# GGUF general.architecture -> our HF family. llama.cpp writes Mistral models as "llama".
ARCHITECTURES = {a: a for a in ("llama", "qwen2", "qwen3", "phi3", "gpt2", "gemma", "gemma2")}
ARCHITECTURES["gemma3"] = "gemma3_text"
# Architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.permute).
PERMUTED_QK = ("llama",)
# Tensor types gguf.quants dequantises (plus the plain float types).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
    "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
    "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4",
)  # fmt: skip


class GGUFFile(GGUFHeader):
    """A parsed GGUF: its checked header (metadata as Python values, the tensor table:
    lmforge.interop.gguf_header) and the tensors left in the file, read through a memory map."""

    def __init__(self, path: str | Path):
        super().__init__(path)
        if int(self.meta.get("split.count", 1)) > 1:
            self.close()
            raise CheckpointError(
                f"{self.path}: one shard of a {self.meta['split.count']}-file split GGUF; merge "
                "the shards first (llama-gguf-split --merge)"
            )
        self.architecture = self.meta.get("general.architecture")

    def blocks(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor as uint8 [rows, bytes per row]: a read-only view of the
        file's memory map (no copy), what gguf.quants.dequantize takes."""
        return self.raw(name).reshape(math.prod(self.tensors[name].shape[:-1]), -1)

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantised to `dtype` (via float32 for the block formats), torch order.
        F32/F16/BF16 tensors are converted straight from the file's bytes."""
        kind, shape = self.tensors[name].type_name, self.tensors[name].shape
        if kind in PLAIN_TYPES:
            raw = torch.from_numpy(self.raw(name).copy())  # one copy, writable
            return raw.view(PLAIN_TYPES[kind]).view(shape).to(dtype)
        import gguf
        from gguf.quants import dequantize

        qtype = gguf.GGMLQuantizationType(self.tensors[name].type_id)
        values = np.ascontiguousarray(dequantize(self.blocks(name), qtype), dtype=np.float32)
        return torch.from_numpy(values).view(shape).to(dtype)

    def key(self, name: str) -> Any:
        """The architecture-scoped metadata value `{arch}.{name}`; a clear error if absent."""
        full = f"{self.architecture}.{name}"
        if full not in self.meta:
            raise CheckpointError(f"{self.path}: metadata key {full!r} is missing")
        return self.meta[full]

    def get(self, name: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.architecture}.{name}", default)


PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# ---- metadata -> HF config ---------------------------------------------------------------------
def _uniform(f: GGUFFile, name: str, value: Any) -> Any:
    """Per-layer arrays (head_count_kv of some files) must hold one value for our model."""
    if isinstance(value, list) and len(set(value)) != 1:
        raise CheckpointError(
            f"{f.path}: {f.architecture}.{name} differs between layers ({sorted(set(value))}); "
            "only uniform layers are supported"
        )
    return value[0] if isinstance(value, list) else value


def _rope_scaling(f: GGUFFile, head_dim: int, theta: float, max_len: int) -> dict | None:
    """HF rope_scaling from `{arch}.rope.scaling.*` (or a Llama 3 `rope_freqs` tensor)."""
    kind = f.get("rope.scaling.type")
    factor = f.get("rope.scaling.factor") or f.get("rope.scale_linear")
    original = f.get("rope.scaling.original_context_length")
    if "rope_freqs.weight" in f.tensors:
        if kind not in (None, "none"):
            raise CheckpointError(f"{f.path}: both rope_freqs and rope.scaling.type={kind!r}")
        return _llama3_from_freq_factors(f, head_dim, theta)
    if kind in (None, "none") and factor in (None, 1.0):
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(original or max_len)}  # fmt: skip
        for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if f.get(f"rope.scaling.{theirs}") is not None:
                scaling[ours] = float(f.get(f"rope.scaling.{theirs}"))
        return scaling
    raise CheckpointError(
        f"{f.path}: {f.architecture}.rope.scaling.type {kind!r} is not supported; "
        "supported: none, linear, yarn (and Llama 3 rope_freqs)"
    )


def _llama3_from_freq_factors(f: GGUFFile, head_dim: int, theta: float) -> dict | None:
    """Llama 3.1's rope_scaling recovered from the per-frequency divisors llama.cpp stores.

    In the smooth band the divisor d satisfies 1/d = 1/s + t (1 - 1/s) with
    t = (L / wavelength - low) / (high - low): linear in 1/wavelength, so two band points fix
    L/(high-low) and low/(high-low); only those ratios change the frequencies, so low = 1 is
    chosen. The result is verified against every divisor in the file.
    """
    name = "rope_freqs.weight"
    if f.tensors[name].shape != (head_dim // 2,):
        raise CheckpointError(
            f"{f.path}: tensor {name} has shape {f.tensors[name].shape}, the GGUF metadata implies "
            f"{(head_dim // 2,)}"
        )
    divisors = f.read(name).double()
    base_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    s = float(divisors.max())
    if s <= 1.0 + 1e-6:
        return None
    band = (divisors > 1 + 1e-4) & (divisors < s * (1 - 1e-4))
    x = base_freq / (2 * math.pi)  # 1 / wavelength
    if int(band.sum()) >= 2:
        t = (1 / divisors[band] - 1 / s) / (1 - 1 / s)
        a, b = np.polyfit(x[band].numpy(), t.numpy(), 1)
        low, high = 1.0, 1.0 - 1.0 / b
        original = a * (high - low)
    else:  # no band to fit: Meta's published values, kept only if they reproduce the file
        low, high, original = 1.0, 4.0, 8192.0
    scaling = {
        "rope_type": "llama3",
        "factor": s,
        "low_freq_factor": low,
        "high_freq_factor": float(high),
        "original_max_position_embeddings": float(original),
    }
    try:
        ours = rope_inv_freq(head_dim, theta, scaling)[0].double()
    except ConfigError as err:
        raise CheckpointError(f"{f.path}: rope_freqs is not Llama 3 scaling ({err})") from err
    if not torch.allclose(base_freq / ours, divisors, rtol=1e-4):
        raise CheckpointError(
            f"{f.path}: tensor rope_freqs does not follow Llama 3 rope scaling; other "
            "per-frequency RoPE factors are not supported"
        )
    return scaling


def hf_config_from_gguf(f: GGUFFile) -> dict[str, Any]:
    """A Hugging Face config dict equivalent to the GGUF metadata (shapes from metadata only)."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{f.path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(ARCHITECTURES)} (Mistral files are 'llama')"
        )
    vocab = f.get("vocab_size") or len(f.meta.get("tokenizer.ggml.tokens") or ())
    if not vocab and "token_embd.weight" in f.tensors:
        vocab = f.tensors["token_embd.weight"].shape[0]
    if not vocab:
        raise CheckpointError(f"{f.path}: no vocabulary size ({arch}.vocab_size or tokens)")
    n_head = _uniform(f, "attention.head_count", f.key("attention.head_count"))
    common = {"vocab_size": int(vocab), "tie_word_embeddings": "output.weight" not in f.tensors}
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if (token_id := f.meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            common[f"{role}_token_id"] = int(token_id)
    if arch == "gpt2":
        return {
            **common, "model_type": "gpt2", "n_embd": f.key("embedding_length"),
            "n_layer": f.key("block_count"), "n_head": n_head,
            "n_inner": f.key("feed_forward_length"), "n_positions": f.key("context_length"),
            "layer_norm_epsilon": f.get("attention.layer_norm_epsilon", 1e-5),
            "activation_function": "gelu_new",  # llama.cpp's GELU is the tanh approximation
        }  # fmt: skip
    hidden = f.key("embedding_length")
    n_kv = _uniform(f, "attention.head_count_kv", f.get("attention.head_count_kv", n_head))
    head_dim = f.get("attention.key_length") or hidden // n_head
    for key in ("attention.value_length", "rope.dimension_count"):
        if f.get(key) not in (None, head_dim):
            raise CheckpointError(
                f"{f.path}: {arch}.{key}={f.get(key)} differs from the head size {head_dim} "
                "(partial RoPE / different value heads are not supported)"
            )
    if "rope_factors_long.weight" in f.tensors or "rope_factors_short.weight" in f.tensors:
        raise CheckpointError(f"{f.path}: LongRoPE (rope_factors_long/short) is not supported")
    theta = float(f.get("rope.freq_base", 10000.0))
    max_len = int(f.key("context_length"))
    hf = {
        **common,
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": f.key("block_count"),
        "intermediate_size": f.key("feed_forward_length"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": f.key("attention.layer_norm_rms_epsilon"),
        "rope_theta": theta,
        "max_position_embeddings": max_len,
        "hidden_act": "silu",
        "rope_scaling": _rope_scaling(f, head_dim, theta, max_len),
    }
    if arch in ("llama", "qwen3"):
        hf["attention_bias"] = "blk.0.attn_q.bias" in f.tensors
    if arch == "llama":
        hf["mlp_bias"] = "blk.0.ffn_up.bias" in f.tensors
    if arch == "phi3":
        hf["sliding_window"] = f.get("attention.sliding_window")
    if arch in ("qwen2", "qwen3") and (window := f.get("attention.sliding_window")):
        hf.update(use_sliding_window=True, sliding_window=window, max_window_layers=0)
    if arch.startswith("gemma"):
        hf.update(_gemma_from_gguf(f, arch, hf))
    return hf


# Gemma 2/3 27B scale queries by (d_model / n_head)^-1/2, the other sizes by head_dim^-1/2;
# GGUF has no key for it, so llama.cpp (src/models/gemma2.cpp, gemma3.cpp) tells the 27B models
# by their layer count, and so do we.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma_from_gguf(f: GGUFFile, arch: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The Gemma fields of an HF config from llama.cpp's metadata and defaults: GeGLU, and for
    Gemma 2/3 the soft caps, the window and which layers use it, the windowed layers' RoPE base."""
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
    if arch == "gemma":
        return out
    n_layer = hf["num_hidden_layers"]
    big = n_layer == _GEMMA_27B_LAYERS[arch]
    out["query_pre_attn_scalar"] = hf["hidden_size"] // hf["num_attention_heads"] if big else None
    out["final_logit_softcapping"] = f.get("final_logit_softcapping") or None
    window = f.get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    if arch == "gemma2":
        out["attn_logit_softcapping"] = f.get("attn_logit_softcapping") or None
    if not window:
        return {**out, "sliding_window": None, "layer_types": ["full_attention"] * n_layer}
    pattern = f.get("attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
    if isinstance(pattern, list):  # one flag per layer: True = windowed
        windowed = [bool(x) for x in pattern]
    else:  # llama.cpp's set_swa_pattern: every n-th layer (the last of each n) is full
        windowed = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layer)]
    out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windowed]
    out["sliding_window"] = window
    local_default = hf["rope_theta"] if arch == "gemma2" else 10000.0
    out["rope_local_base_freq"] = float(f.get("rope.freq_base_swa", local_default))
    return out


# ---- tensors -----------------------------------------------------------------------------------
def gguf_names(architecture: str, n_layer: int, hf_names) -> dict[str, str]:
    """HF tensor name -> its GGUF name (gguf's TensorNameMap), for each of `hf_names`; a name
    gguf has no counterpart for raises LMForgeError (a converter bug, not a user error)."""
    import gguf

    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture)
    names = gguf.get_tensor_name_map(arch, n_layer)
    out = {}
    for hf in hf_names:
        base, suffix = hf.rsplit(".", 1)
        if names.get_name(base) is None:
            raise LMForgeError(f"no GGUF name for {hf} ({architecture})")
        out[hf] = f"{names.get_name(base)}.{suffix}"
    return out


def permute_qk(w: torch.Tensor, n_head: int, reverse: bool = False) -> torch.Tensor:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py's LlamaModel.permute): within each
    head the rotate-half pair (i, i + d/2) becomes the adjacent pair (2i, 2i + 1) its interleaved
    RoPE rotates. reverse=True undoes it (transformers' reverse_permute)."""
    rows = w.shape[0] // n_head // 2
    split = (rows, 2) if reverse else (2, rows)
    return w.reshape(n_head, *split, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_named(
    name: str, tensor: torch.Tensor, config: ModelConfig, arch: str = "llama", reverse=False
) -> torch.Tensor:
    """`permute_qk` on the tensor GGUF stores as `name` when it is a q/k projection of an
    architecture llama.cpp permutes (with that projection's head count); else `tensor`."""
    if arch not in PERMUTED_QK or not (".attn_q." in name or ".attn_k." in name):
        return tensor
    heads = config.n_head if ".attn_q." in name else config.n_kv_head
    return permute_qk(tensor, heads, reverse)


def read_config(f: GGUFFile) -> tuple[ModelConfig, Family]:
    """(our ModelConfig, its HF family) from the GGUF metadata (no tensor is read)."""
    hf = hf_config_from_gguf(f)
    return hf_config_to_ours(hf, str(f.path)), FAMILIES[hf["model_type"]]


def check_tensors(
    f: GGUFFile, family: Family, config: ModelConfig, model: Transformer
) -> dict[str, str]:
    """HF tensor name -> its GGUF name for every tensor our model (`model`, on the meta device)
    needs, after checking the file holds exactly those (plus rope_freqs and a tied output), with
    supported types and the shapes the metadata implies: all before any tensor is read, so bad
    input costs one CheckpointError and no half-built model."""
    expected = hf_shapes(family, config, model.state_dict(), conv1d=False)
    to_gguf = gguf_names(f.architecture, config.n_layer, expected)
    if bad_types := sorted({t.type_name for t in f.tensors.values()} - set(SUPPORTED_TYPES)):
        raise CheckpointError(
            f"{f.path}: tensor type(s) {', '.join(bad_types)} are not supported; supported: "
            f"{', '.join(SUPPORTED_TYPES)}"
        )
    found = {name: t.shape for name, t in f.tensors.items()}
    allowed = {"rope_freqs.weight"} | ({"output.weight"} if config.tie_embeddings else set())
    wanted = {to_gguf[hf_name]: shape for hf_name, shape in expected.items()}
    check_state(f.path, found, wanted, "the GGUF metadata", allowed)
    return to_gguf
