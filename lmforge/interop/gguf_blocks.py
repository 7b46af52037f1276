"""A GGUF file's quantised blocks as they are stored, for the kernels' layouts: llama.cpp's
4 / 5-bit blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1), the K super-blocks of 256 (Q4_K, Q5_K, Q6_K) and
Q8_0, read without dequantising (gguf_load.py repacks them; see ggml-quants.h in llama.cpp for
the block layouts)."""

from __future__ import annotations

import torch

from lmforge.errors import CheckpointError
from lmforge.infer.cpu_kernels import split_codes
from lmforge.interop.gguf_read import GGUFFile

GROUP_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1")  # llama.cpp's 4 / 5-bit blocks of 32
Q8_EXACT_TYPES = ("Q8_0", "Q4_0", "Q5_0")  # w = (q - centre) d: Q8_0 blocks hold them exactly
Q4_BLOCK = Q8_BLOCK = 32


def _stored(f: GGUFFile, name: str, kinds: tuple[str, ...], block: int):
    """(type, rows, K, the stored bytes as uint8 [rows, K / block, bytes per block], a copy) of
    a tensor that must be one of `kinds`."""
    if (kind := f.tensors[name].type_name) not in kinds:
        raise CheckpointError(f"{f.path}: tensor {name} is {kind}, not {' or '.join(kinds)}")
    rows, k = f.tensors[name].shape
    return kind, rows, k, torch.from_numpy(f.blocks(name).copy()).view(rows, k // block, -1)


def read_group_blocks(
    f: GGUFFile, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A Q4_0 / Q4_1 / Q5_0 / Q5_1 tensor's blocks as they are in the file, not dequantised:
    (nibbles uint8 [rows, K/32, 16], d fp16 [rows, K/32], m fp16 [rows, K/32], high int32
    [rows, K/32]) with w = q d + m for the codes q: byte j of a block holds the low 4 bits of
    element j in its low nibble and of j + 16 in its high one; Q5's `qh` holds element j's
    fifth bit at bit j (high None for Q4). A block is an fp16 d, an fp16 m (Q4_1 / Q5_1), the
    4 bytes of qh (Q5) and the 16 bytes (ggml-common.h). Q4_0 and Q5_0 are symmetric,
    w = (q - 8) d and (q - 16) d: m is None (Int4Linear.from_q4_blocks keeps it so)."""
    kind, rows, k, raw = _stored(f, name, GROUP_TYPES, Q4_BLOCK)
    head = (2 if kind.endswith("_0") else 4) + (4 if kind.startswith("Q5") else 0)
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0]
    m = None if kind.endswith("_0") else raw[..., 2:4].contiguous().view(torch.float16)[..., 0]
    high = None
    if kind.startswith("Q5"):  # qh: a little-endian uint32 before the nibbles
        high = raw[..., head - 4 : head].contiguous().view(torch.int32)[..., 0]
    return raw[..., head:].contiguous(), d, m, high


K_GROUP_TYPES = ("Q4_K", "Q5_K")  # super-blocks of 256 whose sub-blocks of 32 map onto groups
QK_K = 256


def read_k_blocks(
    f: GGUFFile, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[float, float]]:
    """A Q4_K / Q5_K tensor's super-blocks of 256 (ggml-common.h's block_q4_K / block_q5_K: fp16
    d and dmin, 12 bytes packing 6-bit scales sc and mins m of the 8 sub-blocks of 32, Q5_K's
    32 bytes of fifth bits, 128 bytes of nibbles; w = d sc q - dmin m) as groups of 32 in
    `read_group_blocks`' form: (nibbles, fp16 d sc, fp16 -dmin m, high or None), exact but for
    rounding those two products to fp16; and (the squared error that rounding causes, the
    squared weights) summed over the tensor, a few rows at a time (no float copy of it)."""
    kind, rows, k, raw = _stored(f, name, K_GROUP_TYPES, QK_K)
    d, dmin = (raw[..., i : i + 2].contiguous().view(torch.float16).float() for i in (0, 2))
    lo, mid, top = raw[..., 4:16].unflatten(-1, (3, 4)).unbind(-2)  # gguf-py's get_scale_min
    sc = torch.cat([lo & 63, top & 15 | lo >> 2 & 48], dim=-1).float()  # [rows, blocks, 8]
    mins = torch.cat([mid & 63, top >> 4 | mid >> 2 & 48], dim=-1).float()
    halves = torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)  # sub-blocks 2c, 2c + 1
    codes = (raw[..., -128:].reshape(rows, -1, 4, 1, 32) >> halves & 15).view(rows, -1, 8, 32)
    if kind == "Q5_K":  # sub-block s's fifth bits: bit s of the 32 bytes of qh
        planes = torch.arange(8, dtype=torch.uint8).view(8, 1)
        codes |= (raw[..., 16:48].reshape(rows, -1, 1, 32) >> planes & 1) << 4
    scale, offset = d * sc, -dmin * mins  # exact in fp32 (11 x 6 significant bits)
    scale16, offset16 = scale.half(), offset.half()
    error = norm = 0.0
    step = max(1, (1 << 20) // k)
    for r in range(0, rows, step):
        q = codes[r : r + step].float()
        exact = q * scale[r : r + step, ..., None] + offset[r : r + step, ..., None]
        ours = q * scale16[r : r + step, ..., None].float() + offset16[r : r + step, ..., None]
        error += float((ours - exact).double().square().sum())
        norm += float(exact.double().square().sum())
    nibbles, high = split_codes(codes.view(rows, k // Q4_BLOCK, Q4_BLOCK))
    return nibbles, scale16.view(rows, -1), offset16.view(rows, -1), high, (error, norm)


def read_q6_k_blocks(f: GGUFFile, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q6_K tensor's super-blocks of 256 (ggml-common.h's block_q6_K: 128 bytes of the codes'
    low 4 bits, 64 of their top 2, 16 int8 scales sc (one per 16), an fp16 d; w = d sc (q - 32))
    unpacked as gguf-py's dequantisation orders them: codes uint8 [rows, K] (0..63), d fp16
    [rows, K / 32] (the super-block's, per group of 32) and sc int8 [rows, K / 16]."""
    _, rows, k, raw = _stored(f, name, ("Q6_K",), QK_K)
    nibbles = raw[..., :128].reshape(rows, -1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8
                                                                         ).view(2, 1)  # fmt: skip
    top = raw[..., 128:192].reshape(rows, -1, 2, 1, 32) >> torch.tensor(
        [0, 2, 4, 6], dtype=torch.uint8).view(4, 1)  # fmt: skip
    codes = (nibbles & 15).reshape(rows, k) | (top & 3).reshape(rows, k) << 4
    sc = raw[..., 192:208].contiguous().view(torch.int8).reshape(rows, k // 16)
    d = raw[..., 208:210].contiguous().view(torch.float16).expand(-1, -1, QK_K // Q4_BLOCK)
    return codes, d.reshape(rows, k // Q4_BLOCK), sc


def read_q8_blocks(f: GGUFFile, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's blocks as stored: (codes int8 [rows, K], scales fp16 [rows, K / 32]);
    a block is an fp16 scale d then 32 int8 codes, w = q d. A Q4_0 / Q5_0 tensor's blocks as
    the same: their centred codes q - 8 / q - 16 with their own d (exact)."""
    if f.tensors[name].type_name in ("Q4_0", "Q5_0"):
        nibbles, d, _, high = read_group_blocks(f, name)
        codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).to(torch.int8)
        if high is not None:
            codes |= (high[..., None] >> torch.arange(Q4_BLOCK, dtype=torch.int32) & 1).to(
                torch.int8) << 4  # fmt: skip
        return (codes - (16 if high is not None else 8)).flatten(1), d
    _, rows, k, raw = _stored(f, name, ("Q8_0",), Q8_BLOCK)
    d = raw[..., :2].contiguous().view(torch.float16)[..., 0]
    return raw[..., 2:].contiguous().view(torch.int8).view(rows, k), d
