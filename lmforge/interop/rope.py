"""RoPE settings between Hugging Face configs and ours.

transformers 5 writes `rope_parameters` ({"rope_theta", "rope_type", ...}); older configs write
`rope_theta` and `rope_scaling` ({"type" or "rope_type", "factor", ...}). Both are read; the
legacy form is written, which every transformers version (and vLLM, llama.cpp's converter) reads.
The scaling functions themselves live in lmforge.model.positions.
"""

from __future__ import annotations

from typing import Any

from lmforge.errors import ConfigError
from lmforge.model.config import ModelConfig
from lmforge.model.positions import check_rope_scaling, rope_scaling_type

_NEEDS_ORIGINAL = ("yarn", "llama3", "dynamic")


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict | None, int]:
    """(rope_base, rope_scaling, max_seq_len) for an HF config dict."""
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    # 10000: transformers' default rope_theta
    theta = scaling.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    kind = scaling.pop("type", None)
    kind = scaling.get("rope_type") or kind or "default"
    partial = scaling.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial} is not supported (only full RoPE)")
    max_len = hf["max_position_embeddings"]
    if kind == "default":
        return float(theta), None, max_len
    scaling["rope_type"] = kind
    if kind in _NEEDS_ORIGINAL:
        # Phi-3 keeps the pretraining length outside rope_scaling; it wins, as in transformers.
        original = hf.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = (
            original or scaling.get("original_max_position_embeddings") or max_len
        )
    if kind == "yarn" and scaling.get("factor") is None:
        scaling["factor"] = max_len / scaling["original_max_position_embeddings"]
    check_rope_scaling(scaling)
    if kind == "dynamic":
        # HF's threshold is max_position_embeddings; our max_seq_len is a hard limit, so allow
        # the factor's worth of extra context.
        scaling["original_max_position_embeddings"] = max_len
        max_len = int(max_len * scaling["factor"])
    return float(theta), scaling, max_len


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """rope_theta / rope_scaling / max_position_embeddings for an exported config.json."""
    kind = rope_scaling_type(config.rope_scaling)
    scaling = {k: v for k, v in (config.rope_scaling or {}).items() if k != "type"}
    out = {"rope_theta": config.rope_base, "max_position_embeddings": config.max_seq_len}
    if kind == "default":
        return out
    if kind == "ntk":  # static NTK is plain RoPE with a larger base: b' = b s^(d/(d-2))
        d = config.head_dim
        return {**out, "rope_theta": config.rope_base * scaling["factor"] ** (d / (d - 2))}
    scaling["rope_type"] = kind
    if kind == "dynamic":  # HF reads the threshold from max_position_embeddings
        out["max_position_embeddings"] = scaling.pop("original_max_position_embeddings")
    return {**out, "rope_scaling": scaling}
