"""Counting: parameters by component, FLOPs per token, KV-cache size. Pure arithmetic on a config,
so it works for 7B presets without allocating them."""

from __future__ import annotations

from lmforge.model.config import ModelConfig


def kv_cache_elements(batch: int, n_kv_head: int, seq_len: int, head_dim: int) -> int:
    """Elements one layer's cache holds: keys and values, 2 * B * n_kv_head * L * d_head."""
    return 2 * batch * n_kv_head * seq_len * head_dim


def kv_cache_bytes_per_token(config: ModelConfig, bytes_per_element: int = 2) -> int:
    """Bytes of cache one more token costs across all layers (bf16 by default)."""
    return (
        config.n_layer
        * kv_cache_elements(1, config.n_kv_head, 1, config.head_dim)
        * (bytes_per_element)
    )


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
    Training is 3x forward (backward costs twice the forward).
    """
    counts = parameter_counts(config)
    ctx = context or config.max_seq_len
    matmul_params = counts["attention"] + counts["mlp"] + config.vocab_size * config.d_model
    attention = 4 * config.n_layer * config.n_head * config.head_dim * ctx
    forward = 2 * matmul_params + attention
    return {"forward": forward, "training": 3 * forward, "context": ctx}


def describe(config: ModelConfig) -> str:
    """A human-readable report for `lmforge model-info`."""
    counts = parameter_counts(config)
    flops = flops_per_token(config)
    lines = [f"{'component':<12}{'parameters':>16}"]
    lines += [f"{k:<12}{v:>16,}" for k, v in counts.items()]
    lines.append("")
    lines.append(f"FLOPs/token forward (ctx {flops['context']}): {flops['forward']:,}")
    lines.append(f"FLOPs/token training: {flops['training']:,}")
    per_tok = kv_cache_bytes_per_token(config)
    lines.append(f"KV cache bytes/token (bf16): {per_tok:,}")
    lines.append(
        f"KV cache at max_seq_len={config.max_seq_len}, batch 1: "
        f"{per_tok * config.max_seq_len / 2**20:,.1f} MiB"
    )
    return "\n".join(lines)
