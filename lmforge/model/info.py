"""Counting: parameters by component, FLOPs per token, KV-cache size, and model FLOPs utilisation
(MFU) against a device's peak. Pure arithmetic on a config, so it works for 7B presets without
allocating them."""

from __future__ import annotations

from lmforge.model.config import ModelConfig


def kv_cache_elements(batch: int, n_kv_head: int, seq_len: int, head_dim: int) -> int:
    """Elements one layer's cache holds: keys and values, 2 * B * n_kv_head * L * d_head."""
    return 2 * batch * n_kv_head * seq_len * head_dim


def kv_cache_bytes_per_token(config: ModelConfig, bytes_per_element: int = 2) -> int:
    """Bytes of cache one more token costs across all layers (bf16 by default)."""
    per_layer = kv_cache_elements(1, config.n_kv_head, 1, config.head_dim)
    return config.n_layer * per_layer * bytes_per_element


def parameter_counts(config: ModelConfig) -> dict[str, int]:
    """Parameters by component, computed from the config (matches Transformer.num_parameters)."""
    d, h, g, dh = config.d_model, config.n_head, config.n_kv_head, config.head_dim
    b = 1 if config.bias else 0
    norm = d * (2 if (config.norm == "layernorm" and config.bias) else 1)
    attn = d * (h + 2 * g) * dh + b * (h + 2 * g) * dh + h * dh * d + b * d
    n_mats = 3 if config.is_glu else 2
    mlp = n_mats * d * config.d_ff + b * ((n_mats - 1) * config.d_ff + d)
    counts = {
        "embedding": config.vocab_size * d,
        "positions": config.max_seq_len * d if config.pos == "learned" else 0,
        "attention": config.n_layer * attn,
        "mlp": config.n_layer * mlp,
        "norms": (2 * config.n_layer + 1) * norm,
        "lm_head": 0 if config.tie_embeddings else config.vocab_size * d,
    }
    counts["total"] = sum(counts.values())
    return counts


def flops_per_token(config: ModelConfig, context: int | None = None) -> dict[str, int]:
    """Forward and training FLOPs per token (Kaplan/PaLM accounting).

    Forward: 2 FLOPs per weight used in a matmul (embedding lookups are free; the LM head is a
    matmul) plus attention scores and mixing, 4 * n_layer * n_head * d_head * context.
    Training is 3x forward (backward costs twice the forward): 6N + 12 * L * H * Q * T, the
    formula of PaLM's Appendix B (Chowdhery et al. 2022, https://arxiv.org/abs/2204.02311) and of
    nanoGPT's `estimate_mfu`, with N the matmul weights and T the context (full attention
    counted, as PaLM does, though a causal mask skips half of it). `context` is the trained
    sequence length (the run's block_size); default max_seq_len.
    """
    counts = parameter_counts(config)
    ctx = context or config.max_seq_len
    matmul_params = counts["attention"] + counts["mlp"] + config.vocab_size * config.d_model
    attention = 4 * config.n_layer * config.n_head * config.head_dim * ctx
    forward = 2 * matmul_params + attention
    return {"forward": forward, "training": 3 * forward, "context": ctx}


# Peak dense (no 2:4 sparsity) bf16 tensor-core TFLOPS from NVIDIA's data sheets, matched in
# order against torch.cuda.get_device_name() (the first pattern it contains wins, so the PCIe
# and NVL parts come before their SXM namesakes: "NVIDIA H100 80GB HBM3" is the SXM H100).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.0),  # SXM5
    ("H200", 989.0),  # SXM (also GH200)
    ("A100", 312.0),  # SXM4 and PCIe alike
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """A GPU's peak dense bf16 TFLOPS by its name (`torch.cuda.get_device_name()`); None for a
    device not in PEAK_BF16_TFLOPS (then MFU needs a given peak)."""
    name = device_name.lower()
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key.lower() in name), None)


def model_flops_utilisation(
    tokens_per_s: float, training_flops_per_token: float, peak_tflops: float
) -> float:
    """MFU (Chowdhery et al. 2022, Appendix B): the model FLOPs a run achieves, tokens/s times
    training FLOPs per token (`flops_per_token(...)["training"]`), as a fraction of the device's
    peak (in TFLOPS, 1e12 FLOP/s). Recomputed activations do not count: they are not model
    FLOPs."""
    return tokens_per_s * training_flops_per_token / (peak_tflops * 1e12)


def describe(config: ModelConfig) -> str:
    """A human-readable report for `lmforge model-info`."""
    counts = parameter_counts(config)
    flops = flops_per_token(config)
    per_tok = kv_cache_bytes_per_token(config)
    lines = [
        f"{'component':<12}{'parameters':>16}",
        *(f"{k:<12}{v:>16,}" for k, v in counts.items()),
        "",
        f"FLOPs/token forward (ctx {flops['context']}): {flops['forward']:,}",
        f"FLOPs/token training: {flops['training']:,}",
        f"KV cache bytes/token (bf16): {per_tok:,}",
        f"KV cache at max_seq_len={config.max_seq_len}, batch 1: "
        f"{per_tok * config.max_seq_len / 2**20:,.1f} MiB",
    ]
    return "\n".join(lines)
