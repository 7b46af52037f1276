"""QLoRA: frozen base weights stored as 4-bit NormalFloat (NF4), dequantised on the fly, plus LoRA.

NF4 (Dettmers et al. 2023): 16 code values at quantiles of N(0, 1), rescaled to [-1, 1], with an
exact zero. A weight is split into blocks of ``block_size``; each block stores its absmax and, per
element, the index of the nearest code to w/absmax — two 4-bit indices per byte (first element in
the high nibble, as bitsandbytes). Double quantisation: the fp32 absmaxes, minus their mean, are
themselves quantised to 8 bits in blocks of 256 with one fp32 scale per block.
"""

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.errors import ConfigError, LMForgeError
from lmforge.peft.lora import LoRALinear, adaptable_linears, apply_lora, name_matches

# QLoRA's offset: the outermost quantile is ½(1 - 1/32 + 1 - 1/30), avoiding ppf(1) = ∞.
NF4_OFFSET = 0.9677083


def nf4_code(offset: float = NF4_OFFSET) -> Tensor:
    """The 16 NF4 values, computed as the paper does (bitsandbytes ``create_normal_map``): 8
    positive quantiles of N(0, 1) over [offset, ½), 7 negative ones, and 0, divided by the max."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (values / values.max()).float()


NF4_CODE = nf4_code()


def pack_4bit(codes: Tensor) -> Tensor:
    """Two 4-bit codes (values 0..15, even count) per uint8: the first in the high nibble."""
    codes = codes.to(torch.uint8).view(-1, 2)
    return (codes[:, 0] << 4) | codes[:, 1]


def unpack_4bit(packed: Tensor) -> Tensor:
    """Inverse of ``pack_4bit``: uint8 [n] → codes uint8 [2n]."""
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).flatten()


@dataclass
class NF4Weight:
    """A quantised tensor. ``absmax`` is fp32 per block, or int8 codes when ``absmax_scale``
    (fp32 per 256-block of absmaxes) and ``absmax_offset`` (their mean) are set."""

    packed: Tensor
    absmax: Tensor
    shape: torch.Size
    block_size: int
    absmax_scale: Tensor | None = None
    absmax_offset: Tensor | None = None
    dq_block_size: int = 256


def _blocks(x: Tensor, size: int) -> Tensor:
    """Flatten and zero-pad ``x`` into rows of ``size``."""
    flat = x.flatten()
    return F.pad(flat, (0, (-flat.numel()) % size)).view(-1, size)


def quantize_nf4(
    w: Tensor, block_size: int = 64, double_quant: bool = True, dq_block_size: int = 256
) -> NF4Weight:
    """Quantise ``w`` (any shape) to NF4 with per-block absmax scales, double-quantised if asked."""
    if block_size <= 0 or block_size % 2:
        raise ConfigError(f"NF4 block_size must be a positive even number, got {block_size}")
    blocks = _blocks(w.detach().float(), block_size)
    absmax = blocks.abs().amax(dim=1)
    normed = blocks / absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
    code = NF4_CODE.to(w.device)
    # nearest code = number of midpoints below the value
    codes = torch.bucketize(normed, (code[1:] + code[:-1]) / 2)
    q = NF4Weight(pack_4bit(codes.flatten()), absmax, w.shape, block_size)
    if double_quant:
        q.absmax_offset = absmax.mean()
        centred = _blocks(absmax - q.absmax_offset, dq_block_size)
        q.absmax_scale = centred.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        q8 = torch.round(centred / q.absmax_scale.unsqueeze(1) * 127).to(torch.int8)
        q.absmax, q.dq_block_size = q8.flatten()[: absmax.numel()], dq_block_size
    return q


def dequantize_absmax(q: NF4Weight) -> Tensor:
    """The per-block fp32 scales (undoing double quantisation if it was used)."""
    if q.absmax_scale is None:
        return q.absmax.float()
    scales = _blocks(q.absmax.float(), q.dq_block_size) / 127 * q.absmax_scale.unsqueeze(1)
    return scales.flatten()[: q.absmax.numel()] + q.absmax_offset


def dequantize_nf4(q: NF4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """Rebuild the dense tensor: code[index] · absmax of its block."""
    codes = NF4_CODE.to(q.packed.device)[unpack_4bit(q.packed).long()]
    values = codes.view(-1, q.block_size) * dequantize_absmax(q).unsqueeze(1)
    return values.flatten()[: q.shape.numel()].view(q.shape).to(dtype)


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4 (buffers, no parameters) and
    dequantised to ``compute_dtype`` on every forward; outputs come back in the input's dtype."""

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None = None,
        block_size: int = 64,
        double_quant: bool = True,
        compute_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block_size, self.compute_dtype = block_size, compute_dtype
        q = quantize_nf4(weight, block_size, double_quant)
        self.register_buffer("qweight", q.packed)
        self.register_buffer("absmax", q.absmax)
        self.register_buffer("absmax_scale", q.absmax_scale)
        self.register_buffer("absmax_offset", q.absmax_offset)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: int = 64, **kwargs) -> "NF4Linear":
        """Quantise an existing nn.Linear."""
        return cls(linear.weight, linear.bias, block_size, **kwargs)

    def quantized(self) -> NF4Weight:
        """The buffers as an ``NF4Weight``."""
        shape = torch.Size((self.out_features, self.in_features))
        return NF4Weight(
            self.qweight, self.absmax, shape, self.block_size, self.absmax_scale, self.absmax_offset
        )

    def dequantized_weight(self) -> Tensor:
        """The dense [out, in] weight in ``compute_dtype``."""
        return dequantize_nf4(self.quantized(), self.compute_dtype)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out = F.linear(x.to(self.compute_dtype), self.dequantized_weight(), bias)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        dq = self.absmax_scale is not None
        return f"{self.in_features}, {self.out_features}, block_size={self.block_size}, dq={dq}"


class QLoRALinear(LoRALinear):
    """LoRA on a frozen NF4 base. Merging into 4 bits would requantise, so in-place ``merge`` is
    refused; ``merge_lora(model)`` exports a dequantised nn.Linear with the update folded in."""

    def _init_base(self, base: nn.Module) -> None:
        if not isinstance(base, NF4Linear):
            raise ConfigError(f"QLoRALinear needs an NF4Linear base, got {type(base).__name__}")
        self.base = base

    @property
    def bias(self) -> Tensor | None:
        return self.base.bias

    def base_forward(self, x: Tensor) -> Tensor:
        return self.base(x)

    def base_weight(self) -> Tensor:
        return self.base.dequantized_weight()

    def merge(self) -> None:
        raise LMForgeError("cannot merge LoRA into a 4-bit base in place; use merge_lora(model)")


def apply_qlora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    targets: str | Iterable[str] = ("q_proj", "v_proj"),
    keep: str | Iterable[str] = ("lm_head",),
    block_size: int = 64,
    double_quant: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Quantise every nn.Linear to NF4 except names matching ``keep`` (kept in full precision),
    add LoRA on names matching ``targets``, freeze everything else. Returns the LoRA names."""

    def nf4(linear: nn.Linear) -> NF4Linear:
        return NF4Linear.from_linear(linear, block_size, double_quant=double_quant,
                                     compute_dtype=compute_dtype)  # fmt: skip

    def wrap(name: str, linear: nn.Linear) -> LoRALinear:
        if name_matches(name, keep):
            return LoRALinear(linear, r, alpha, dropout)
        return QLoRALinear(nf4(linear), r, alpha, dropout)

    names = apply_lora(model, r, alpha, dropout, targets, wrap)
    for n in adaptable_linears(model):  # what is left: the Linears without LoRA
        if not name_matches(n, keep):
            model.set_submodule(n, nf4(model.get_submodule(n)))
    return names
