"""Position information: learned and sinusoidal absolute embeddings, and rotary embeddings (RoPE).

Absolute embeddings are added to the token embeddings; RoPE rotates queries and keys inside
attention. Every module takes `positions` (LongTensor [T] shared by the batch, or [B, T] when
left-padded rows start at different offsets), so cached decoding and padding need no special case.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lmforge.errors import ConfigError


def sinusoidal_table(n_positions: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(...): shape [n_positions, dim]."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]
    freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(n_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table.float()


class LearnedPositions(nn.Module):
    """nanoGPT's `wpe`: one trained vector per absolute position."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(max_seq_len, dim))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.weight[positions]


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal table (Vaswani et al.), stored as a non-persistent buffer."""

    def __init__(self, max_seq_len: int, dim: int):
        super().__init__()
        self.max_seq_len, self.dim = max_seq_len, dim
        self.register_buffer("table", torch.empty(max_seq_len, dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the table, e.g. after building the model on the meta device."""
        self.table = sinusoidal_table(self.max_seq_len, self.dim).to(self.table.device)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions]


# config.pos -> the absolute-position module added to the token embeddings. The other kinds:
# "rope" rotates queries and keys inside attention (RotaryEmbedding), "none" adds nothing (NoPE).
ABSOLUTE_POSITIONS: dict[str, type[nn.Module]] = {
    "learned": LearnedPositions,
    "sinusoidal": SinusoidalPositions,
}
POSITION_KINDS = (*ABSOLUTE_POSITIONS, "rope", "none")  # every valid config.pos


def _default_freq(head_dim: int, base: float) -> torch.Tensor:
    # Rounded as transformers computes it (float32 exponents and pow; nanochat and llama.cpp
    # also work in float32): float64 here made imported checkpoints' logits drift ~1e-4 from
    # transformers' at long positions. Returned in float64 for the scalings' arithmetic.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return (1.0 / (base**exponents)).double()


def yarn_mscale(s: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature 0.1 * mscale * ln(s) + 1 (1.0 for s <= 1), folded into cos/sin."""
    return 1.0 if s <= 1 else 0.1 * mscale * math.log(s) + 1.0


def _yarn(freq: torch.Tensor, head_dim: int, base: float, scaling: dict):
    """YaRN (Peng et al. 2023, arXiv:2309.00071): planes that turn more than beta_fast times over
    the original context L keep their frequency, planes turning fewer than beta_slow times are
    interpolated (divided by s), with a linear ramp in plane index between the two correction dims
    (floored/ceiled unless truncate=False), exactly as transformers computes it."""
    s = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(s, mscale) / yarn_mscale(s, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(s)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: high-frequency plane kept as is; 0: interpolated
    return freq / s * (1 - keep) + freq * keep, float(attention_factor)


def _llama3(freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: wavelengths above L/low_freq_factor are divided by s, below L/high_freq_factor
    kept, and smoothly interpolated in between."""
    s, original = scaling["factor"], scaling["original_max_position_embeddings"]
    low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > original / low_factor, freq / s, freq)
    smooth = (original / wavelen - low_factor) / (high_factor - low_factor)
    smoothed = (1 - smooth) * scaled / s + smooth * scaled
    medium = (wavelen >= original / high_factor) & (wavelen <= original / low_factor)
    return torch.where(medium, smoothed, scaled)


# rope_scaling["rope_type"] -> the keys it requires. Hugging Face names, plus "ntk".
ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}


def rope_scaling_type(scaling: dict | None) -> str:
    """The rope_type of an HF-style rope_scaling dict (old configs call it "type")."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def check_rope_scaling(scaling: dict | None) -> None:
    """Raise ConfigError for an unknown rope_type or a missing required key."""
    kind = rope_scaling_type(scaling)
    if kind not in ROPE_SCALINGS:
        raise ConfigError(
            f"unknown rope_scaling type {kind!r}; supported: {', '.join(ROPE_SCALINGS)}"
        )
    if missing := [k for k in ROPE_SCALINGS[kind] if (scaling or {}).get(k) is None]:
        raise ConfigError(f"rope_scaling type {kind!r} needs {', '.join(missing)}")


def rope_inv_freq(
    head_dim: int, base: float, scaling: dict | None = None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies base^(-2k/d) for each rotated plane, and the attention scale factor
    (multiplied into cos and sin, so scores scale by its square, as in HF's YaRN).

    `scaling` follows Hugging Face's `rope_scaling` dict; `seq_len` (the current sequence length)
    only matters for "dynamic".
    """
    check_rope_scaling(scaling)
    kind, scaling = rope_scaling_type(scaling), scaling or {}
    s, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
    if kind == "ntk":
        # static NTK-aware scaling: a larger base b' = b * s^(d/(d-2)) (bloc97 2023, "NTK-Aware
        # Scaled RoPE"; transformers' "dynamic" without the growth)
        base = base * s ** (head_dim / (head_dim - 2))
    elif kind == "dynamic":
        # dynamic NTK (HF "dynamic"): the NTK base grown for the current length T once it exceeds
        # L, b' = b * (s * T / L - (s - 1))^(d/(d-2)), so sequences within L are unscaled
        t = max(seq_len or original, original)
        base = base * (s * t / original - (s - 1)) ** (head_dim / (head_dim - 2))
    freq, mscale = _default_freq(head_dim, base), 1.0
    if kind == "linear":  # position interpolation: every frequency divided by s
        freq = freq / s
    elif kind == "yarn":
        freq, mscale = _yarn(freq, head_dim, base, scaling)
    elif kind == "llama3":
        freq = _llama3(freq, scaling)
    return freq.float(), mscale


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables and the rotation applied to queries and keys.

    Two pairings exist in the wild: `interleaved` rotates (x0, x1), (x2, x3), ... (the RoFormer
    paper and the seed notes); the default rotates (x_i, x_{i+d/2}) ("rotate_half", used by
    Hugging Face Llama checkpoints). They are the same function up to a permutation of the
    head dimensions, so this flag is the one place the layout difference is handled.
    """

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        base: float = 10000.0,
        interleaved: bool = False,
        scaling: dict | None = None,
    ):
        super().__init__()
        self.head_dim, self.max_seq_len, self.base = head_dim, max_seq_len, base
        self.interleaved, self.scaling = interleaved, scaling
        check_rope_scaling(scaling)  # fail at build time, not at the first forward
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the cos/sin tables, e.g. after building the model on the meta device."""
        device = self.cos.device
        if device.type == "meta":  # shapes only (no values to compute): made when materialised
            return
        positions = torch.arange(self.max_seq_len, dtype=torch.float32)
        cos, sin = self._cos_sin(positions, *rope_inv_freq(self.head_dim, self.base, self.scaling))
        self.cos, self.sin = cos.to(device), sin.to(device)

    def _cos_sin(self, positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float):
        angles = positions.float()[..., None] * inv_freq.to(positions.device)
        if self.interleaved:
            angles = angles.repeat_interleave(2, dim=-1)
        else:
            angles = torch.cat([angles, angles], dim=-1)
        return angles.cos() * mscale, angles.sin() * mscale

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos/sin for `positions`, shaped to broadcast against [B, H, T, head_dim]."""
        cos, sin = self.cos[positions], self.sin[positions]
        if rope_scaling_type(self.scaling) == "dynamic":
            # HF semantics: past the original context, frequencies depend on the current length
            # (the largest position + 1); keys already in a cache keep their rotation.
            seq_len = int(positions.max()) + 1
            if seq_len > self.scaling["original_max_position_embeddings"]:
                freq = rope_inv_freq(self.head_dim, self.base, self.scaling, seq_len)
                cos, sin = self._cos_sin(positions, *freq)
        cos, sin = cos.to(dtype), sin.to(dtype)
        if positions.dim() == 2:  # per-row positions [B, T] -> [B, 1, T, D]
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    # A fused kernel (x, cos, sin) -> the rotate-half result below for fp32 on a CPU, or None.
    # Inference sets lmforge's native one (infer/quantize.py inference_model): one pass where
    # torch takes five ops (negation, concatenation, two products, a sum) at every layer.
    kernel = None

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, head_dim] rotated by the `tables` cos and sin."""
        if self.kernel is not None and x.dtype == torch.float32 == cos.dtype:
            if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
                return self.kernel(x, cos, sin)
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))
            rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        else:
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
