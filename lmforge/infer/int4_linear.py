"""Int4 inference Linear layers: group-wise 4-bit weights in two layouts, asymmetric (fp16 scale
and offset per group of 32, GGUF Q4_1's layout, what `--quantize int4` makes) and symmetric
(fp16 scale only, offset -8 x scale, GGUF Q4_0's), each run by lmforge's CPU kernels
(native/quantized_matmul.cpp) where they fit and by torch's int4 kernels elsewhere; their 5-bit
versions (GGUF Q5_1 / Q5_0 as stored) and int6 (GGUF Q6_K as stored: `Int6Linear`), lmforge's
CPU kernels only. The shared machinery (QuantizedLinear, the kernel choice by rows) is in
quantized_linear.py."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError
from lmforge.infer.cpu_kernels import (
    BLOCK,
    INT4_CODE_BYTES,
    INT5_HIGH_BYTES,
    LANES,
    group_codes,
    int4_symmetric,
    int5,
    native_kernels,
    pack_int4,
    pack_int4_nibbles,
    pack_int6,
    unpack_int4,
    unpack_int6,
)
from lmforge.infer.quantized_linear import QuantizedLinear, cpu_kernel_dtype

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 kernels accept
DEFAULT_GROUP_SIZE = 32  # llama.cpp's Q4 block: GGUF Q4_0/Q4_1 map without regrouping


def quantize_int4(
    weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric int4 (min/max per group of `group_size` input columns):
    weight [N, K] -> (q uint8 [N, K] in 0..15, scale fp32 [N, K/g], zero fp32 [N, K/g]) with
    w ≈ (q - 8) * scale + zero (torch's int4pack convention)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group_size, group_size)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(n, k), scale, lo + 8 * scale


def check_int4_shape(name: str, in_features: int, group_size: int) -> None:
    """ConfigError naming the layer (and a group size that would work) when `in_features` is not
    a multiple of the group size."""
    sizes = INT4_GROUP_SIZES
    if group_size not in sizes:
        raise ConfigError(f"int4 group size must be one of {list(sizes)}, got {group_size}")
    if in_features % group_size == 0:
        return
    fits = [g for g in sizes if in_features % g == 0]
    hint = "no int4 group size divides it (use --quantize int8)"
    if fits:
        hint = f"use group size {fits[-1] if group_size > fits[-1] else fits[0]}"
    raise ConfigError(
        f"int4: layer {name or '?'} has in_features={in_features}, not a multiple of the group "
        f"size {group_size}; {hint}"
    )


class Int4Linear(QuantizedLinear):
    """int4 weights, group-wise scale and zero (w = (q - 8) * scale + zero). On a CPU where the
    native kernel is built and groups are 32, in its layout (cpu_kernels.pack_int4, fp16 scales
    and offsets; llama.cpp's Q4_0 blocks in its symmetric layout, scales only: `symmetric`);
    otherwise through torch's int4pack kernels. On CPU that kernel's packed layout
    is blocks of 32 output rows with rows r and r + 16 sharing a byte (checked once per process,
    `_cpu_layout_known`); the GEMM path unpacks from it, or, on a torch build where the check
    fails, from a plain copy of the codes.
    Output rows are padded to a multiple of 32 for the kernel (zero weights, sliced off)."""

    bits = 4

    def __init__(
        self,
        linear: nn.Linear,
        dtype: torch.dtype = torch.bfloat16,
        group_size: int = DEFAULT_GROUP_SIZE,
        name: str = "",
    ):
        check_int4_shape(name, linear.in_features, group_size)
        q, scale, zero = quantize_int4(linear.weight, group_size)
        self._pack(q, scale, zero, linear.bias, dtype, group_size)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "",
    ) -> Int4Linear:
        """From codes already quantised (e.g. a GGUF Q4_0/Q4_1 tensor): codes [N, K] in 0..15,
        scale and zero [N, K/g] with w = (q - 8) * scale + zero."""
        n, k = codes.shape
        group_size = k // scale.shape[1]
        check_int4_shape(name, k, group_size)
        self = cls.__new__(cls)
        self._pack(codes.to(torch.uint8), scale.float(), zero.float(), bias, dtype, group_size)
        return self

    @classmethod
    def from_q4_blocks(
        cls,
        nibbles: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        name: str = "",
        high: torch.Tensor | None = None,
    ) -> Int4Linear:
        """From llama.cpp Q4_1 blocks as stored: nibbles uint8 [N, K / 32, 16] (byte j: element
        j low, j + 16 high), fp16 d and m [N, K / 32], w = q d + m; or from Q4_0 blocks (m None:
        w = (q - 8) d). The native kernel's layouts are the same bytes and fp16 values
        interleaved, so they are packed as they are (Q4_0 into the symmetric one). With `high`
        (int32 [N, K / 32], element j's fifth bit at bit j): Q5_1 / Q5_0 blocks (w = q d + m or
        (q - 16) d, codes 0..31) into the 5-bit layouts, which only the native kernels run."""
        n, groups, _ = nibbles.shape
        native = native_kernels() if nibbles.device.type == "cpu" else None
        if native is not None:
            self = cls.__new__(cls)
            QuantizedLinear.__init__(self, groups * BLOCK, n, bias, dtype)
            self.group_size = BLOCK
            self._keep_native(native, pack_int4_nibbles(nibbles, d, m, high))
            return self
        if high is not None:
            raise ConfigError(f"{name or 'a layer'}: 5-bit blocks need lmforge's CPU kernels")
        codes = torch.stack([nibbles & 15, nibbles >> 4], dim=2).view(n, groups * BLOCK)
        scale = d.float()
        zero = torch.zeros_like(scale) if m is None else m.float() + 8 * scale
        return cls.from_codes(codes, scale, zero, bias, dtype, name)

    @property
    def symmetric(self) -> bool:
        """Whether the weights are held in the native kernel's symmetric layout (no offsets)."""
        packed = self._buffers.get("native_packed")
        return packed is not None and int4_symmetric(packed)

    @property
    def centre(self) -> int:
        """The code that a symmetric layout maps to 0 (w = (q - centre) d): 8, or 16 in 5 bits."""
        return 1 << self.bits - 1

    def extra_repr(self) -> str:
        return super().extra_repr() + (" symmetric" if self.symmetric else "")

    def _keep_native(self, native, packed: torch.Tensor) -> None:
        """Hold the weights only in the native kernel's layout (`packed`, from pack_int4)."""
        self._native, self.padded = native, self.out_features
        self.bits = 5 if int5(packed) else 4
        self.register_buffer("native_packed", packed)
        for name in ("scale_zeros", "kernel_scale_zeros", "weight_int4", "codes"):
            self.register_buffer(name, None)

    def _pack(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias,
              dtype: torch.dtype, group_size: int) -> None:  # fmt: skip
        """Set the module up from codes q [N, K] and their group scales and zeros."""
        n, k = q.shape
        QuantizedLinear.__init__(self, k, n, bias, dtype)
        self.group_size = group_size
        self._native = None
        if q.device.type == "cpu" and group_size == BLOCK and (native := native_kernels()):
            d, m = scale.half(), (zero - 8 * scale).half()  # w = q * d + m
            if bool(torch.isfinite(d).all() and torch.isfinite(m).all()):  # fp16 holds them
                return self._keep_native(native, pack_int4(q, d, m))
        self.register_buffer("native_packed", None)
        rows = (0, 0, 0, -n % 32)  # padded with zero rows: code 8, scale 1, zero 0 -> weight 0
        q, scale, zero = F.pad(q, rows, value=8), F.pad(scale, rows, value=1), F.pad(zero, rows)
        self.padded = q.shape[0]
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K/g, N, 2]
        self.register_buffer("scale_zeros", sz.to(self.dtype))
        cuda = q.device.type == "cuda"
        kernel = self.dtype if cuda else cpu_kernel_dtype(self.dtype)
        self.register_buffer("kernel_scale_zeros", sz.to(kernel), persistent=False)
        if cuda:
            plain = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
            tiles = next(t for t in (8, 4, 2) if k % (t * 16) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack(plain, tiles)
            self.register_buffer("codes", None)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            keep = None if _cpu_layout_known() else (q[:, ::2] | q[:, 1::2] << 4).to(torch.uint8)
            self.register_buffer("codes", keep)  # plain nibbles, only where the layout is unknown
        self.register_buffer("weight_int4", packed)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        if self._native is not None:
            if x.device.type != "cpu":  # moved off the CPU after quantising: the GEMM
                return self.gemm(x)
            fp32 = x if x.dtype == torch.float32 else x.float()
            y = self._native.int4_matmul(fp32, buffers["native_packed"], self.out_features)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        packed, sz = buffers["weight_int4"], buffers["kernel_scale_zeros"]
        xk = x if x.dtype == sz.dtype else x.to(sz.dtype)
        if x.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(xk, packed, self.group_size, sz)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xk, packed, self.group_size, sz)
        if self.padded != self.out_features:
            y = y[:, : self.out_features]
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def unpacked_codes(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The codes (uint8 0..15) of output rows start:stop (start a multiple of 32)."""
        stop = self.padded if stop is None else stop
        if self._native is not None:
            return unpack_int4(self.packed_blocks(start, stop), stop - start)[0]
        plain = self._buffers["codes"]
        if plain is not None:
            rows = plain[start:stop]
            return torch.stack([rows & 15, rows >> 4], dim=-1).view(rows.shape[0], -1)
        end = -(-stop // 32) * 32
        blocks = self._buffers["weight_int4"][start:end].view(-1, self.in_features, 16)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).transpose(1, 2)  # [blocks, 32, K]
        return q.reshape(-1, self.in_features)[: stop - start]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self._buffers["native_packed"]
        if self._native is None or packed.device.type != "cpu":
            return super().rows(ids)
        t, groups = ids.numel(), packed.shape[1]
        blocks, lane, every = packed[ids // LANES], ids % LANES, torch.arange(t)
        c = blocks[..., :INT4_CODE_BYTES].view(t, groups, 4, LANES, 4)[every, :, :, lane]
        at, high = INT4_CODE_BYTES, None
        if self.bits == 5:  # the fifth bits: one 4-byte piece per row
            at += INT5_HIGH_BYTES
            high = blocks[..., INT4_CODE_BYTES:at].view(t, groups, LANES, 4)[every, :, lane]
        q = group_codes(c.reshape(t, groups, BLOCK // 2), high)
        scales = blocks[..., at:].contiguous().view(torch.half)  # [t, G, 16 or 32]
        d = scales[every, :, lane]  # then m, unless symmetric
        m = None if int4_symmetric(packed) else scales[every, :, LANES + lane]
        return self._weights(q, d, m, self.dtype).view(t, self.in_features)

    def _weights(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        """w = q d + m (or (q - centre) d) in `dtype` from codes [.., G, 32] and fp16 d, m
        [.., G], in torch ops (as the kernel computes it: fp32, then rounded)."""
        q = q.float()
        if m is None:
            return ((q - self.centre) * d.float()[..., None]).to(dtype)
        return (q * d.float()[..., None] + m.float()[..., None]).to(dtype)

    def dequantize(self, start=0, stop=None, dtype=None) -> torch.Tensor:
        stop, dtype = self.out_features if stop is None else stop, dtype or self.dtype
        if self._native is not None:  # w = q * d + m from the kernel's own fp16 scales
            blocks = self.packed_blocks(start, stop)
            if blocks.device.type != "cpu":  # the same formula in torch ops (the kernel is CPU's)
                codes, d, m = unpack_int4(blocks, stop - start)
                w = self._weights(codes.view(stop - start, -1, BLOCK), d, m, dtype)
                return w.view(stop - start, self.in_features)
            made = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
            return self._native.dequantize_int4(blocks, stop - start, made).to(dtype)
        q = self.unpacked_codes(start, stop).to(self.dtype)
        sz = self._buffers["scale_zeros"][:, start:stop]  # [K/g, rows, 2]
        g = self.group_size
        scale, zero = sz[..., 0].t()[:, :, None], sz[..., 1].t()[:, :, None]
        w = (q.view(stop - start, -1, g) - 8) * scale + zero
        return w.view(stop - start, self.in_features).to(dtype)


class Int6Linear(QuantizedLinear):
    """llama.cpp's Q6_K weights as stored, in lmforge's int6 kernel (native/quantized_matmul.cpp):
    codes 0..63 with an fp16 d per group of 32 and an int8 scale per 16 columns, w = d sc
    (q - 32), 7 bits a weight (Q6_K's own 6.56: its d is per 256); CPU kernels only. Off the
    CPU (or for the embedding's rows) the weights are dequantised in torch ops."""

    bits = 6

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor,
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.float32):  # fmt: skip
        """codes uint8 [N, K] (0..63), fp16 d [N, K / 32], int8 sc [N, K / 16]."""
        native = native_kernels() if codes.device.type == "cpu" else None
        if native is None:
            raise ConfigError("int6 (Q6_K) weights need lmforge's CPU kernels")
        n, k = codes.shape
        super().__init__(k, n, bias, dtype)
        self._native, self.group_size = native, BLOCK
        self.register_buffer("native_packed", pack_int6(codes, d, sc))

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # moved off the CPU: the GEMM on dequantised weights
            return self.gemm(x)
        fp32 = x if x.dtype == torch.float32 else x.float()
        y = self._native.int4_matmul(fp32, self._buffers["native_packed"], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def dequantize(self, start=0, stop=None, dtype=None) -> torch.Tensor:
        stop = self.out_features if stop is None else stop
        first = start // LANES * LANES
        blocks = self.packed_blocks(start, stop)
        codes, d, sc = (t[start - first :] for t in unpack_int6(blocks, stop - first))
        scale = d.float().repeat_interleave(2, dim=1) * sc.float()  # d sc, then q: as gguf-py
        w = scale.repeat_interleave(16, dim=1) * (codes.float() - 32)
        return w.to(dtype or self.dtype)


@functools.cache
def _cpu_layout_known() -> bool:
    """Whether this torch build's CPU int4 packing is the layout `Int4Linear.unpacked_codes`
    reads (blocks of 32 output rows, row r in the low nibble and r + 16 in the high one)."""
    q = torch.randint(0, 16, (64, 64), generator=torch.Generator().manual_seed(0))
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    except (RuntimeError, AttributeError):
        return False
    blocks = q.view(2, 32, 64)
    expect = (blocks[:, :16] | blocks[:, 16:] << 4).transpose(1, 2).reshape(64, 32)
    return packed.shape == expect.shape and torch.equal(packed, expect.to(torch.uint8))
