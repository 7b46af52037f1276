"""Load a CLIP or SigLIP vision tower from a Hugging Face directory into lmforge's VisionEncoder.

LLaVA uses a pretrained CLIP tower as its vision encoder. Both CLIP and SigLIP are the ViT of
vision.py with a few switches (VisionConfig fields): CLIP has a CLS token, a bias-free patch
embedding, a LayerNorm before the blocks, QuickGELU, and its last_hidden_state skips the final
LayerNorm; SigLIP has no CLS, tanh-GELU and a final LayerNorm. Each flavour is one small spec
(FLAVOURS); the weights are renamed into VisionEncoder's names and q/k/v are fused into one matrix.
Accepted directories: a CLIPVisionModel / SiglipVisionModel (config.json describes the tower) or a
full CLIPModel / SiglipModel (its config.json has `vision_config`; weights under `vision_model.`).
The SigLIP pooling head and CLIP's projection are not loaded: image tokens are per-patch features.
Pixels go in as the HF model expects them (its own mean/std normalisation, not load_image's).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lmforge.errors import CheckpointError
from lmforge.fileio import check_state, load_tensors, read_json
from lmforge.vlm.vision import VisionConfig, VisionEncoder

# How each HF vision tower family maps onto VisionConfig (norm_eps: when config.json has none).
FLAVOURS = {
    "clip": dict(use_cls=True, patch_bias=False, pre_norm=True, final_norm=False, norm_eps=1e-5),
    "siglip": dict(use_cls=False, patch_bias=True, pre_norm=False, final_norm=True, norm_eps=1e-6),
}
HF_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def hf_vision_config(path: str | Path) -> tuple[VisionConfig, str]:
    """VisionConfig and flavour ("clip" | "siglip") for the vision tower in an HF directory."""
    source = Path(path) / "config.json"
    meta = read_json(source, "HF config")
    model_type = str(meta.get("model_type", ""))  # clip, clip_vision_model, siglip, ...
    flavour = next((name for name in FLAVOURS if model_type.startswith(name)), None)
    if flavour is None:
        raise CheckpointError(f"{source}: model_type {model_type!r} is not a CLIP or SigLIP model")
    vision = meta.get("vision_config", meta)
    spec = FLAVOURS[flavour]
    act = vision.get("hidden_act", "quick_gelu" if flavour == "clip" else "gelu_pytorch_tanh")
    if act not in HF_ACTS:
        raise CheckpointError(f"{source}: hidden_act {act!r} is not one of {sorted(HF_ACTS)}")
    try:
        config = VisionConfig(
            image_size=vision["image_size"], patch_size=vision["patch_size"],
            channels=vision.get("num_channels", 3), d_model=vision["hidden_size"],
            n_layer=vision["num_hidden_layers"], n_head=vision["num_attention_heads"],
            d_ff=vision["intermediate_size"], act=HF_ACTS[act],
            **{**spec, "norm_eps": vision.get("layer_norm_eps", spec["norm_eps"])},
        )  # fmt: skip
    except KeyError as err:
        raise CheckpointError(f"{source}: vision config lacks the field {err}") from err
    return config, flavour


def _rename(state: dict[str, torch.Tensor], config: VisionConfig) -> dict[str, torch.Tensor]:
    """HF tensor names -> VisionEncoder names (q, k, v fused in that order)."""
    hf = {k.removeprefix("vision_model."): v for k, v in state.items()}
    get = hf.__getitem__
    out = {
        "patch_embed.proj.weight": get("embeddings.patch_embedding.weight"),
        "pos": get("embeddings.position_embedding.weight").unsqueeze(0),
    }
    if config.patch_bias:
        out["patch_embed.proj.bias"] = get("embeddings.patch_embedding.bias")
    if config.use_cls:
        out["cls"] = get("embeddings.class_embedding").view(1, 1, -1)
    norms = [(config.pre_norm, "pre_norm", "pre_layrnorm"),
             (config.final_norm, "norm", "post_layernorm")]  # fmt: skip
    for used, ours, theirs in norms:
        for kind in ("weight", "bias") if used else ():
            out[f"{ours}.{kind}"] = get(f"{theirs}.{kind}")
    for i in range(config.n_layer):
        src, dst = f"encoder.layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            qkv = [get(f"{src}self_attn.{n}_proj.{kind}") for n in ("q", "k", "v")]
            out[f"{dst}attn.qkv_proj.{kind}"] = torch.cat(qkv)
            pairs = {"attn.o_proj": "self_attn.out_proj", "attn_norm": "layer_norm1",
                     "mlp_norm": "layer_norm2", "mlp.up_proj": "mlp.fc1",
                     "mlp.down_proj": "mlp.fc2"}  # fmt: skip
            for ours, theirs in pairs.items():
                out[f"{dst}{ours}.{kind}"] = get(f"{src}{theirs}.{kind}")
    return out


def load_hf_vision_tower(path: str | Path) -> VisionEncoder:
    """A VisionEncoder holding the CLIP/SigLIP vision weights of the HF directory `path`; its
    output equals the HF model's last_hidden_state for the same pixels."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"HF model directory not found: {path}")
    config, _ = hf_vision_config(path)
    weights = path / "model.safetensors"
    try:
        state = _rename(load_tensors(weights), config)
    except KeyError as err:
        raise CheckpointError(f"{weights}: missing vision tensor {err}") from err
    encoder = VisionEncoder(config)
    check_state(weights, state, encoder.state_dict())
    encoder.load_state_dict(state)
    return encoder.eval()
