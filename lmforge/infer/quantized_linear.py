"""Inference Linear layers: the shared base (`QuantizedLinear`), weight-only int8 (per output
channel; int4's group-wise layers build on the base in int4_linear.py), 16-bit weights through
lmforge's GEMV (`HalfLinear`), and the kernel each product runs through (see
lmforge/infer/quantize.py, which converts a model and picks the activation dtype, for the why of
each choice).

- lmforge's CPU kernels (native/quantized_matmul.cpp) take every product of a layer they fit
  (inputs a multiple of 32; int4 groups of 32), decode and prefill alike, with the weights kept
  only in the kernels' interleaved layout.
- Elsewhere torch's: `aten._weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` (CUDA:
  `_weight_int4pack_mm`) below `gemm_rows` rows, a GEMM on dequantised weights from there.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import ConfigError
from lmforge.infer.cpu_kernels import (
    BLOCK,
    LANES,
    native_kernels,
    pack_int8,
    pack_q8,
    unpack_int8,
    unpack_q8,
)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight [N, K] -> (q int8 [N, K], scale fp32 [N])."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def cpu_kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype torch's CPU weight-only kernels are fed: bf16 unless the model runs
    in fp16 (their fp32 variants are far slower; see the module docstring)."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


class QuantizedLinear(nn.Module, abc.ABC):
    """A frozen Linear with quantised weights. `matmul` picks the kernel: lmforge's own (native)
    CPU kernel at every number of rows where it is built; otherwise torch's weight-only GEMV
    below `gemm_rows` and a GEMM with dequantised weights at or above."""

    gemm_rows = 8  # where torch's bf16 GEMM overtakes its int8 GEMV (docs/benchmarks.md)
    # cpu_kernels.NativeKernels where this layer runs lmforge's kernel. It multiplies a block of 16
    # weight rows by up to 4 rows of x per pass, so it stays compute-efficient at any batch
    # (vpdpbusd does 64 products per instruction, the bf16 dot 32).
    _native = None
    chunk_weights = 1 << 20  # weights dequantised at once by the fp32 GEMM path (4 MB)
    bits = 0
    # bf16 where `--dtype auto` chose fp32 activations on a CPU with bf16 units: the GEMM
    # rounds its fp32 inputs to bf16 (the int8 values are exact in bf16) and runs at about twice
    # the fp32 one's rate. None: the GEMM multiplies in the activations' dtype.
    gemm_dtype: torch.dtype | None = None

    def __init__(self, in_features: int, out_features: int, bias, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim == 2:  # the model's attention and MLP pass [B*T, in]
            return self.matmul(x)
        y = self.matmul(x.reshape(-1, x.shape[-1]))
        return y.view(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] -> [M, out]."""
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self._native is not None or x.shape[0] < self.gemm_rows or x.device.type == "cuda":
            y = self.gemv(x)
        else:
            y = self.gemm(x)
        bias = self._buffers["bias"]  # a plain dict lookup: nn.Module.__getattr__ is slow
        return y if bias is None else y + bias

    @abc.abstractmethod
    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """Few-row product through the weight format's own kernel (int8 / int4 subclasses)."""

    @abc.abstractmethod
    def dequantize(
        self, start: int = 0, stop: int | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Output rows start:stop of the weight, dequantised to `dtype` (default: the
        activation dtype)."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows `ids` (1-d) dequantised to the activation dtype: an embedding lookup in a
        table stored in this layer (`QuantizedEmbedding`). This generic version dequantises the
        aligned 32-row block around each distinct id; the kernels' layouts override it."""
        unique, inverse = torch.unique(ids, return_inverse=True)
        out = torch.empty(len(unique), self.in_features, dtype=self.dtype, device=ids.device)
        for i, r in enumerate(unique.tolist()):
            start = r // 32 * 32
            block = self.dequantize(start, min(start + 32, self.out_features), self.dtype)
            out[i] = block[r - start]
        return out[inverse]

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows: a GEMM over the dequantised weights, a chunk of output rows at a time (the
        chunk stays in cache; no full-size copy is kept), in `compute_dtype(x)`."""
        n, compute = self.out_features, self.compute_dtype(x)
        xc = x.to(compute)
        step = max(32, self.chunk_weights // self.in_features // 32 * 32)
        if step >= n:
            return F.linear(xc, self.dequantize(dtype=compute)).to(x.dtype)
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        for start in range(0, n, step):
            stop = min(start + step, n)
            out[:, start:stop] = F.linear(xc, self.dequantize(start, stop, compute))
        return out

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the GEMM multiplies x in (`gemm_dtype` for fp32 inputs on a CPU)."""
        if self.gemm_dtype is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return self.gemm_dtype
        return x.dtype

    def packed_blocks(self, start: int, stop: int) -> torch.Tensor:
        """The blocks of the native kernel's layout that hold output rows start:stop."""
        return self._buffers["native_packed"][start // LANES : -(-stop // LANES)]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}"


class Int8Linear(QuantizedLinear):
    """int8 weights with one scale per output channel (symmetric, absmax / 127)."""

    bits = 8

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__(linear.in_features, linear.out_features, linear.bias, dtype)
        q, scale = quantize_int8(linear.weight)
        self.register_buffer("scale", scale.to(dtype))
        kernel = cpu_kernel_dtype(dtype)
        # the GEMV kernel wants its scales in its input dtype (bf16 even for fp32 activations)
        self.register_buffer("kernel_scale", self.scale.to(kernel), persistent=False)
        # lmforge's own CPU kernel (native/quantized_matmul.cpp) where it builds and the rows
        # fit its blocks: the weights are kept in its layout only (`int8_rows` unpacks them for
        # the GEMM)
        fits = q.device.type == "cpu" and q.shape[1] % BLOCK == 0
        self._native = native_kernels() if fits else None
        packed = padded = None
        if self._native is not None:
            packed = pack_int8(q)
            padded = F.pad(scale.float(), (0, packed.shape[0] * LANES - len(scale)))
            q = None
        self.register_buffer("weight_int8", q)
        self.register_buffer("native_packed", packed)
        self.register_buffer("native_scale", padded, persistent=False)
        self._gemm_weight: torch.Tensor | None = None  # q in bf16, made on the first large call

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        if x.device.type != "cpu" or self.in_features % 16:
            # no int8 GEMV kernel on a GPU; and torch 2.13's CPU one returns garbage when the
            # inputs are not a multiple of 16 (tests/infer/test_cpu_kernels.py): the GEMM
            return self.gemm(x)
        if self._native is not None:
            packed, scale = buffers["native_packed"], buffers["native_scale"]
            fp32 = x if x.dtype == torch.float32 else x.float()  # a call saved per layer
            y = self._native.int8_matmul(fp32, packed, scale, self.out_features)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        scale = buffers["kernel_scale"]
        if x.dtype == scale.dtype:
            return torch.ops.aten._weight_int8pack_mm(x, buffers["weight_int8"], scale)
        y = torch.ops.aten._weight_int8pack_mm(x.to(scale.dtype), buffers["weight_int8"], scale)
        return y.to(x.dtype)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        compute = self.compute_dtype(x)
        if compute == torch.float32:
            return super().gemm(x)
        # bf16/fp16: q in that dtype is exact, so one copy serves every call; scale the output
        weight = self._gemm_weight
        if weight is None or weight.device != x.device or weight.dtype != compute:
            weight = self._gemm_weight = self.int8_rows().to(compute)
        return (F.linear(x.to(compute), weight) * buffers["scale"]).to(x.dtype)

    def int8_rows(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The int8 weights of output rows start:stop (start a multiple of 16)."""
        stop = self.out_features if stop is None else stop
        if self._buffers["native_packed"] is None:
            return self._buffers["weight_int8"][start:stop]
        return unpack_int8(self.packed_blocks(start, stop), stop - start)

    def dequantize(self, start=0, stop=None, dtype=None) -> torch.Tensor:
        q, scale = self.int8_rows(start, stop), self._buffers["scale"][start:stop]
        return (q.to(self.dtype) * scale[:, None]).to(dtype or self.dtype)


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 (ggml-quants.c quantize_row_q8_0_ref): per block of 32 input columns
    d = absmax / 127 stored as fp16 and q = round(w / d): weight [N, K] -> (q int8 [N, K],
    d fp16 [N, K / 32])."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // BLOCK, BLOCK)
    d = w.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(n, k), d.half()


class BlockInt8Linear(QuantizedLinear):
    """int8 weights with an fp16 scale per output row and block of 32 inputs, w = q * d:
    llama.cpp's Q8_0, which a GGUF's Q8_0 tensors map onto code for code (`from_blocks`). On a
    CPU with the native kernels, in their q8 layout (cpu_kernels.pack_q8) at every number of rows;
    elsewhere a GEMM on dequantised weights (`QuantizedLinear.gemm`)."""

    bits = 8

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.float32):
        if linear.in_features % BLOCK:
            raise ConfigError(f"Q8_0 needs inputs in blocks of {BLOCK}, got {linear.in_features}")
        q, d = quantize_q8(linear.weight)
        self._pack(q, d, linear.bias, dtype)

    @classmethod
    def from_blocks(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> BlockInt8Linear:
        """From Q8_0 blocks as stored: codes int8 [N, K], scale fp16 [N, K / 32]."""
        if codes.shape[1] != scale.shape[1] * BLOCK:
            raise ConfigError(f"Q8_0: {tuple(scale.shape)} scales for {tuple(codes.shape)} codes")
        self = cls.__new__(cls)
        self._pack(codes, scale, bias, dtype)
        return self

    def _pack(self, q: torch.Tensor, d: torch.Tensor, bias, dtype: torch.dtype) -> None:
        n, k = q.shape
        QuantizedLinear.__init__(self, k, n, bias, dtype)
        self._native = native = native_kernels() if q.device.type == "cpu" else None
        self.register_buffer("native_packed", None if native is None else pack_q8(q, d))
        self.register_buffer("codes", q.to(torch.int8).contiguous() if native is None else None)
        self.register_buffer("block_scale", d.half().contiguous() if native is None else None)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is None or x.device.type != "cpu":
            return self.gemm(x)
        fp32 = x if x.dtype == torch.float32 else x.float()
        y = self._native.q8_matmul(fp32, self._buffers["native_packed"], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def blocks(self, start: int = 0, stop: int | None = None):
        """(codes int8, scales fp16) of output rows start:stop (start a multiple of 16)."""
        stop = self.out_features if stop is None else stop
        if self._buffers["native_packed"] is None:
            return self._buffers["codes"][start:stop], self._buffers["block_scale"][start:stop]
        return unpack_q8(self.packed_blocks(start, stop), stop - start)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self._buffers["native_packed"]
        if packed is None:
            q, d = self._buffers["codes"][ids], self._buffers["block_scale"][ids]
        else:  # each id's lane of its 16-row block (quantized_matmul.cpp's interleaved layout)
            t, groups = ids.numel(), packed.shape[1]
            blocks, lane, every = packed[ids // LANES], ids % LANES, torch.arange(t)
            pieces = blocks[..., : LANES * BLOCK].view(t, groups, 8, LANES, 4)[every, :, :, lane]
            q = (pieces.reshape(t, groups, BLOCK).to(torch.int16) - 128).to(torch.int8)
            scales = blocks[..., LANES * BLOCK :].contiguous().view(torch.half)
            d = scales[every, :, lane]
        return self._weights(q, d, self.dtype)

    def dequantize(self, start=0, stop=None, dtype=None) -> torch.Tensor:
        return self._weights(*self.blocks(start, stop), dtype or self.dtype)

    def _weights(self, q: torch.Tensor, d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """w = q d in `dtype` from codes [rows, K] and their fp16 scales [rows, K / 32]."""
        t = q.shape[0]  # not len(q): an int, which torch.export would fix to the example's
        w = q.float().view(t, -1, BLOCK) * d.float()[..., None]
        return w.view(t, self.in_features).to(dtype)


class HalfLinear(QuantizedLinear):
    """A Linear whose bf16 / fp16 weights stay as stored (a GGUF's F16 / BF16 tensors) while the
    model computes in `dtype` (fp32 by default): on a CPU with the native kernels lmforge's dense
    matmul (native/dense_matmul.cpp: the weights converted exactly, fp32 sums; a GEMV for a
    decode step's rows, a blocked GEMM above), except bf16 weights above `torch_bf16_rows` rows
    where the CPU has AVX512-BF16: there the activations are rounded to bf16 for the bf16 dot
    product (2x the fp32 one), through lmforge's bf16 tile up to `native_bf16_rows` rows (a
    large batch's decode step: torch's GEMM repacks the weights on every call, which costs
    more than the product at so few rows) and torch's bf16 GEMM above; elsewhere torch's
    matmul in the weights' dtype."""

    bits = 16
    torch_bf16_rows = 8
    native_bf16_rows = 16

    def __init__(self, weight: torch.Tensor, bias=None, dtype: torch.dtype = torch.float32):
        if weight.dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(f"HalfLinear takes bf16 or fp16 weights, got {weight.dtype}")
        n, k = weight.shape
        super().__init__(k, n, bias, dtype)
        self.register_buffer("weight_half", weight.detach().contiguous())
        self._native = native_kernels() if weight.device.type == "cpu" else None
        self._torch_bf16 = weight.dtype == torch.bfloat16 and self._native is not None and (
            self._native.variant == "avx512_bf16")  # fmt: skip

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        w = self._buffers["weight_half"]
        cpu = x.device.type == "cpu"
        if self._native is not None and cpu:
            rows = x.shape[0]
            if not self._torch_bf16 or rows <= self.torch_bf16_rows:
                return self._native.dense_matmul(x, w)
            if rows <= self.native_bf16_rows:
                return self._native.dense_matmul(x.to(w.dtype), w).to(x.dtype)
        elif cpu and w.dtype == torch.float16:  # torch's CPU fp16 GEMM is slow at any size
            return QuantizedLinear.gemm(self, x)  # fp32 on chunks of converted rows
        return F.linear(x.to(w.dtype), w).to(x.dtype)

    gemm = gemv  # gemv itself hands many rows to a GEMM

    @property
    def takes_bf16(self) -> bool:
        """Whether `bf16_product` applies: bf16 weights on the CPU's bf16 dot product, no bias."""
        return self._torch_bf16 and self._buffers["bias"] is None

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 x [rows, in] -> bf16 x w^T through torch's bf16 GEMM, for a caller that keeps
        many rows of activations in bf16 from one layer to the next (quantize.SwiGLU) rather
        than through `gemv`'s conversions to and from the model's dtype."""
        return F.linear(x, self._buffers["weight_half"])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self._buffers["weight_half"][ids].to(self.dtype)

    def dequantize(self, start=0, stop=None, dtype=None) -> torch.Tensor:
        return self._buffers["weight_half"][start:stop].to(dtype or self.dtype)

    def extra_repr(self) -> str:
        kind = str(self._buffers["weight_half"].dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"


class StackedLinear(QuantizedLinear):
    """A fused layer (e.g. qkv) whose parts' output rows are held by layers of different formats
    (a GGUF file's llama-quantize mix: q and k Q4_K, v Q6_K): each part multiplies x through its
    own kernel and the outputs are joined, so every part stays exactly as stored."""

    def __init__(self, parts: list[QuantizedLinear], bias, dtype: torch.dtype):
        super().__init__(parts[0].in_features, sum(p.out_features for p in parts), bias, dtype)
        self.parts = nn.ModuleList(parts)
        self.bits = max(p.bits for p in parts)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.matmul(x) for part in self.parts], dim=-1)

    gemm = gemv

    def dequantize(self, start=0, stop=None, dtype=None) -> torch.Tensor:
        stop, pieces, first = self.out_features if stop is None else stop, [], 0
        for part in self.parts:
            lo, hi = max(start, first), min(stop, first + part.out_features)
            if lo < hi:  # the parts' layouts start at a multiple of 32 rows
                aligned = (lo - first) // 32 * 32
                rows = part.dequantize(aligned, hi - first, dtype or self.dtype)
                pieces.append(rows[lo - first - aligned :])
            first += part.out_features
        return torch.cat(pieces)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class QuantizedEmbedding(nn.Module):
    """A token embedding whose table is kept in a QuantizedLinear's own layout (int8 / int4 /
    Q8_0 blocks / 16-bit): a lookup dequantises only the rows it reads. The LM head of a tied
    model is that same layer, so the table is stored once, as in a GGUF file. `weight` is a
    zero-row tensor that carries only the device and the activation dtype (what callers read
    from `model.embed.weight`); the table itself is `table`."""

    def __init__(self, table: QuantizedLinear):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features
        stand_in = torch.empty(0, table.in_features, dtype=table.dtype)
        self.register_buffer("weight", stand_in, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        return self.table.rows(flat).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, stored as {self.table.extra_repr()}"
