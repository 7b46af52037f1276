"""lmforge's native CPU kernels (lmforge/infer/native/) as torch ops: the int8 / int4 / Q8_0
products of decode and prefill (quantized_matmul.cpp), the decode products with 16-bit or fp32
weights as stored (dense_matmul.cpp) and the decode attention (decode_attention.cpp); their
weight layouts.

Why by hand: see the header of quantized_matmul.cpp (torch's int8 GEMV converts every weight to
float and runs well below the memory bandwidth; integer dot products with activations quantised
per block of 32, as llama.cpp's Q8_0 and Q4_0 do, run at about twice its speed).

Runtime dispatch: every source is compiled once per instruction-set variant (`VARIANTS`: its -m
flags, no -march=native) into one library, and at load the best variant this CPU's flags allow
is chosen (`pick_variant`, from cpu_features.py), as llama.cpp's GGML_CPU_ALL_VARIANTS builds
do. So one build serves any x86-64 (an AVX2-only Zen 3, AVX-512 with or without VNNI/BF16, AMX
machines) and a kernel cache shared between machines stays valid; `portable` (plain C++) runs
anywhere. torch's extension builder compiles the torch binding (torch_ops.cpp) and links the
variants into $LMFORGE_CACHE/kernels (~/.cache/lmforge/kernels), keyed by the sources, the
compiler and torch: about half a minute once, then a load. As torch ops (`torch.ops.lmforge.
int8_matmul`, ...) they run eagerly through the dispatcher and inside the decode step AOTInductor
compiles (steps.ExportedStep). Where there is no C++ compiler or ninja, the build fails, or
LMFORGE_NATIVE_KERNELS=0, `native_kernels()` is None and the layers keep torch's kernels
(quantize.py decides, per layer kind).

    kernels = native_kernels()
    if kernels is not None:
        packed = pack_int8(weight_int8)  # once, at load: 16 rows interleaved
        y = kernels.int8_matmul(x, packed, scale_fp32_padded_to_the_blocks, weight_int8.shape[0])
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from lmforge.fileio import cache_root

NATIVE = Path(__file__).with_name("native")
KERNEL_SOURCES = tuple(NATIVE / name for name in
                       ("quantized_matmul.cpp", "dense_matmul.cpp", "decode_attention.cpp",
                        "prefill_attention.cpp", "activations.cpp", "row_ops.cpp",
                        "variant_table.cpp"))  # fmt: skip
BINDING = NATIVE / "torch_ops.cpp"  # compiled once, by torch's extension builder
HEADERS = (NATIVE / "kernels.h", NATIVE / "simd.h")  # part of the build's key
BLOCK = 32  # activation values per scale: the kernels need in_features % BLOCK == 0
_fakes: set[str] = set()  # op namespaces whose shape functions are registered

_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd")
_AVX2_FLAGS = frozenset({"avx2", "fma", "f16c"})
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
# The variants, best first (native/kernels.h lists the same names): name -> (the compiler
# flags, the /proc/cpuinfo flags a CPU needs to run it).
VARIANTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512_bf16": ((*_AVX512, "-mavx512vnni", "-mavx512bf16"),
                    _AVX512_FLAGS | {"avx512_vnni", "avx512_bf16"}),  # Zen 4, Sapphire Rapids
    "avx512_vnni": ((*_AVX512, "-mavx512vnni"), _AVX512_FLAGS | {"avx512_vnni"}),  # Ice Lake
    "avx512": (_AVX512, _AVX512_FLAGS),  # Skylake-X
    "avx2": (_AVX2, _AVX2_FLAGS),  # Haswell, Zen 1-3
    "portable": ((), frozenset()),  # any x86-64 (and other architectures)
}  # fmt: skip


def runnable_variants(flags: frozenset[str], machine: str) -> list[str]:
    """The variants a CPU with these /proc/cpuinfo `flags` runs, best first (on anything but
    x86-64 only `portable`)."""
    x86 = machine.lower() in ("x86_64", "amd64")
    return [n for n, (_, need) in VARIANTS.items() if not need or (x86 and need <= flags)]


def pick_variant() -> str:
    """The variant this CPU runs: LMFORGE_KERNEL_VARIANT when set (a name it runs), else the
    best of `runnable_variants`."""
    from lmforge.infer.cpu_features import cpu_features

    f = cpu_features()
    runnable = runnable_variants(f.flags, f.machine)
    asked = os.environ.get("LMFORGE_KERNEL_VARIANT")
    if asked and asked not in runnable:
        raise RuntimeError(f"LMFORGE_KERNEL_VARIANT={asked}: this CPU runs {runnable}")
    return asked or runnable[0]


class NativeKernels:
    """The ops of one built library, running the variant `variant` (`use`). The products are the
    torch ops themselves (a decode step calls them ~50 times: no Python in between):

    - int8_matmul(x, packed, scale, n): x [M, K] fp32 times int8 weights [n, K] -> [M, n] fp32;
      `packed` from `pack_int8`, fp32 `scale` [packed rows] per output row (x is quantised to
      int8 per block of 32 inside).
    - int4_matmul(x, packed, n) / q8_matmul(x, packed, n): the same for int4 (`pack_int4`:
      asymmetric, or symmetric without offsets, told apart by the packed block's bytes) and
      llama.cpp's Q8_0 weights (`pack_q8`).
    - dense_matmul(x, w): x [M, K] times bf16 / fp16 / fp32 weights [N, K] as the model holds
      them -> [M, N] in x's dtype (products and sums in fp32), for the few rows of a decode step.
    - decode_attention(q, k, v, mask): one query per row over its cache: q [B, H, 1, D] fp32,
      k / v [B, KV, L, D] fp32, fp16 or bf16 (unit stride along D), mask None or bool [B, L] or
      [B, 1, 1, L] (True: a real key) -> [B, H, 1, D] fp32, scaled by D ** -0.5.
    - prefill_attention(q, k, v): causal attention of T queries over the same T keys: q
      [B, H, T, D], k / v [B, KV, T, D] fp32 (unit stride along D) -> [B, H, T, D] fp32 (laid out
      [B, T, H, D]), scaled by D ** -0.5.
    - silu_mul(gate, up, bf16): silu(gate) * up elementwise in fp32 (SwiGLU's activation), gate
      and up fp32 or bf16 -> bf16 when `bf16`, else fp32.
    - rms_norm(x, w, eps): RMSNorm over x's last dim in fp32, x and w fp32 or bf16 -> x's dtype.
    - argmax_rows(x): each row's largest value's index in x [M, N] fp32 (the first of equals, the
      first NaN if any, as torch.max) -> [M] int64.
    - rope_rotate_half(x, cos, sin): x cos + rotate_half(x) sin (RoPE, Hugging Face's pairing),
      x [B, H, T, D] fp32 (unit stride along D), cos / sin broadcasting to [B, 1, T, D] ->
      [B, H, T, D] contiguous, the bits torch's eager ops give."""

    OPS = (
        "int8_matmul int4_matmul q8_matmul dense_matmul decode_attention prefill_attention "
        "silu_mul rms_norm argmax_rows rope_rotate_half"
    ).split()

    def __init__(self, namespace: str):
        self.namespace, self.ops = namespace, getattr(torch.ops, namespace)
        for op in self.OPS:
            setattr(self, op, getattr(self.ops, op))

    @property
    def variant(self) -> str:
        """The instruction-set variant the ops run ("avx512_bf16", "avx2", "portable", ...)."""
        return self.ops.kernel_variant()

    def variants(self) -> list[str]:
        """Every variant the library holds, best first."""
        return list(self.ops.kernel_variants())

    def use(self, variant: str) -> None:
        """Run `variant` from now on, in this process (the tests run each one the CPU can)."""
        self.ops.use_kernel_variant(variant)

    def __deepcopy__(self, memo) -> NativeKernels:  # the library is per process: layers share it
        return self

    def __reduce__(self):  # torch.ops namespaces do not pickle: look the library up again
        return NativeKernels, (self.namespace,)

    def dequantize_int4(self, packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The int4 weights [n, K] (w = q * scale + offset, or (q - 8) * scale when symmetric)
        in `dtype` (fp32 or bf16)."""
        return self.ops.dequantize_int4(packed, n, dtype == torch.bfloat16)


# ---- the weight layout (quantized_matmul.cpp, "the interleaved layout") -------------------------
LANES = 16  # output rows per block: one per 32-bit lane of a 512-bit register


def _interleave(rows: torch.Tensor, fill: int) -> torch.Tensor:
    """uint8 [N, K / 32, B] (B bytes per row and group) -> [ceil(N / 16), K / 32, 16 B], the
    4-byte pieces of 16 rows alternating; missing rows are filled with the byte `fill`."""
    n, groups, nbytes = rows.shape
    pad = -n % LANES
    if pad:
        rows = torch.cat([rows, rows.new_full((pad, groups, nbytes), fill)])
    blocks = rows.view(-1, LANES, groups, nbytes // 4, 4).permute(0, 2, 3, 1, 4)
    return blocks.reshape(-1, groups, LANES * nbytes).contiguous()


def _deinterleave(packed: torch.Tensor, nbytes: int, n: int, at: int = 0) -> torch.Tensor:
    """The inverse of `_interleave` for the 16 nbytes from byte `at` of every block: uint8
    [n, K/32, B]."""
    blocks, groups, _ = packed.shape
    pieces = packed[:, :, at : at + LANES * nbytes].reshape(blocks, groups, nbytes // 4, LANES, 4)
    return pieces.permute(0, 3, 1, 2, 4).reshape(blocks * LANES, groups, nbytes)[:n]


def pack_int8(weight: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] -> the int8 kernel's layout: uint8 [ceil(N / 16), K / 32, 512],
    each weight stored as w + 128 (padding rows are weight 0)."""
    n, k = weight.shape
    unsigned = weight.to(torch.int8).view(torch.uint8) ^ 0x80  # w + 128 in two's complement
    return _interleave(unsigned.view(n, k // BLOCK, BLOCK), 128)


def unpack_int8(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack_int8`: the int8 weights [n, K]."""
    rows = _deinterleave(packed, BLOCK, n).reshape(n, -1)
    return (rows.to(torch.int16) - 128).to(torch.int8)


def _per_block(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """fp16 [N, G] per row and group -> uint8 [blocks, G, 32]: each group's 16 rows' values."""
    n = t.shape[0]
    t = torch.cat([t.half(), t.new_zeros(blocks * LANES - n, t.shape[1], dtype=torch.half)])
    return t.view(blocks, LANES, -1).transpose(1, 2).contiguous().view(torch.uint8)


def _per_row(packed: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """The inverse of `_per_block` for the 32 bytes at `lo` of every block: fp16 [n, G]."""
    blocks, groups, _ = packed.shape
    t = packed[:, :, lo : lo + 2 * LANES].contiguous().view(torch.half)  # [blocks, G, 16]
    return t.transpose(1, 2).reshape(blocks * LANES, groups)[:n]


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 codes q [N, K] with an fp16 `scale` [N, K / 32] (w = q * scale, llama.cpp's Q8_0)
    -> the q8 kernel's layout: uint8 [ceil(N / 16), K / 32, 544]: the int8 block (`pack_int8`),
    then the 16 rows' scales."""
    codes = pack_int8(q)
    return torch.cat([codes, _per_block(scale, codes.shape[0])], dim=-1).contiguous()


def unpack_q8(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q8`: int8 codes [n, K] and fp16 scales [n, K / 32]."""
    return unpack_int8(packed, n), _per_row(packed, LANES * BLOCK, n)


INT4_CODE_BYTES = LANES * BLOCK // 2  # a block's codes: 16 rows x 32 columns, two a byte
INT5_HIGH_BYTES = 4 * LANES  # 5-bit layouts: then the 16 rows' fifth bits, 4 bytes a row
INT4_BYTES = INT4_CODE_BYTES + 4 * LANES  # then 16 fp16 scales and 16 fp16 offsets
INT4_SYM_BYTES = INT4_CODE_BYTES + 2 * LANES  # symmetric: the scales only (offset -8 * scale)
# bit t of a row's fifth-bit byte j is column 4 t + j's, bit 4 + t column 16 + 4 t + j's
# (quantized_matmul.cpp: one shift lines a plane up with the nibbles it completes)
_FIFTH_BYTE = torch.arange(BLOCK) % 4
_FIFTH_SHIFT = torch.arange(BLOCK) % 16 // 4 + 4 * (torch.arange(BLOCK) // 16)


def pack_int4(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """Codes q [N, K] (0..15, or 0..31: the 5-bit layout) with fp16 `scale` and `offset`
    [N, K / 32] (w = q * scale + offset) -> the int4 kernel's layout: uint8
    [ceil(N / 16), K / 32, 320]: per block the codes (byte j of a row's group: column j in the
    low nibble, column j + 16 in the high one), then the 16 rows' scales, then their offsets.
    offset None: the symmetric layout, w = (q - 8) * scale (llama.cpp's Q4_0), [.., 288] bytes:
    the codes and the scales. Codes above 15: `pack_int4_nibbles` with their fifth bits."""
    n, k = q.shape
    nibbles, high = split_codes(q.reshape(n, k // BLOCK, BLOCK))
    return pack_int4_nibbles(nibbles, scale, offset, high)


def split_codes(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes [.., 32] of groups (0..15, or 0..31) as llama.cpp's Q4 / Q5 blocks store them:
    nibbles uint8 [.., 16] (byte j: column j low, j + 16 high) and, where a code exceeds 15,
    the fifth bits int32 [..] (column j's at bit j; else None)."""
    g = q.to(torch.int32)
    high = None
    if bool((g > 15).any()):
        high = ((g >> 4 & 1) << torch.arange(BLOCK, dtype=torch.int32)).sum(-1, dtype=torch.int32)
    half = BLOCK // 2
    return (g[..., :half] & 15 | (g[..., half:] & 15) << 4).to(torch.uint8), high


def pack_int4_nibbles(
    nibbles: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None = None,
    high: torch.Tensor | None = None,
) -> torch.Tensor:
    """`pack_int4` from codes already in bytes: nibbles uint8 [N, K / 32, 16] (byte j: column j
    low, j + 16 high, as llama.cpp's Q4_0 / Q4_1 blocks store them). `high`: the codes' fifth
    bits, int32 [N, K / 32] with column j's at bit j (llama.cpp's Q5_0 / Q5_1 `qh`): the 5-bit
    layout, w = q * scale + offset or (q - 16) * scale, [.., 384] or [.., 352] bytes."""
    codes = _interleave(nibbles, 0)
    blocks = codes.shape[0]
    parts = [codes]
    if high is not None:
        bits = (high[..., None] >> torch.arange(BLOCK, dtype=torch.int32) & 1).to(torch.uint8)
        parts.append(_bit_plane(bits))
    parts.append(_per_block(scale, blocks))
    if offset is not None:
        parts.append(_per_block(offset, blocks))
    return torch.cat(parts, dim=-1).contiguous()


def _bit_plane(bits: torch.Tensor) -> torch.Tensor:
    """One bit of each code, uint8 0 / 1 [N, G, 32], as the kernel's plane of those bits:
    [blocks, G, 64], bit t of a row's byte j column 4 t + j's, bit 4 + t column 16 + 4 t + j's."""
    shifts = torch.arange(8, dtype=torch.uint8).view(2, 4, 1)  # [low / high nibbles, t, j]
    planes = bits.view(*bits.shape[:-1], 2, 4, 4) << shifts
    return _interleave(planes.sum((-3, -2), dtype=torch.uint8), 0)


def _plane_bits(plane: torch.Tensor) -> torch.Tensor:
    """The inverse of `_bit_plane` for one row's bytes [.., 4]: the bits [.., 32] (0 / 1)."""
    return plane[..., _FIFTH_BYTE] >> _FIFTH_SHIFT.to(torch.uint8) & 1


INT6_BYTES = INT4_CODE_BYTES + 2 * INT5_HIGH_BYTES + 4 * LANES  # then fp16 d and 2 int8 sc a row


def pack_int6(codes: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q6_K as codes [N, K] (0..63), an fp16 `d` [N, K / 32] and int8 scales `sc`
    [N, K / 16] (w = d sc (q - 32)) -> the int6 kernel's layout: uint8 [ceil(N / 16), K / 32,
    448]: per block the codes' nibbles (as int4's), their bits 4 and 5 as two planes (as
    int5's fifth bits), the 16 rows' d, then their scales of columns 0..15 and of 16..31."""
    n, k = codes.shape
    q = codes.view(n, k // BLOCK, BLOCK).to(torch.uint8)
    nibbles, _ = split_codes(q & 15)
    parts = [_interleave(nibbles, 0), _bit_plane(q >> 4 & 1), _bit_plane(q >> 5 & 1)]
    blocks = parts[0].shape[0]
    parts.append(_per_block(d, blocks))
    pad = torch.zeros(blocks * LANES - n, k // BLOCK, 2, dtype=torch.int8)
    scales = torch.cat([sc.view(n, k // BLOCK, 2).to(torch.int8), pad])
    scales = scales.view(blocks, LANES, -1, 2).permute(0, 2, 3, 1)  # [blocks, G, lo / hi, row]
    parts.append(scales.reshape(blocks, k // BLOCK, 2 * LANES).view(torch.uint8))
    return torch.cat(parts, dim=-1).contiguous()


def unpack_int6(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_int6`: codes uint8 [n, K], fp16 d [n, K / 32], int8 sc [n, K / 16]."""
    blocks, groups, _ = packed.shape
    codes = group_codes(_deinterleave(packed, BLOCK // 2, n),
                        _deinterleave(packed, 4, n, INT4_CODE_BYTES))  # fmt: skip
    codes |= _plane_bits(_deinterleave(packed, 4, n, INT4_CODE_BYTES + INT5_HIGH_BYTES)) << 5
    at = INT4_CODE_BYTES + 2 * INT5_HIGH_BYTES
    sc = packed[:, :, at + 2 * LANES :].contiguous().view(torch.int8).view(blocks, groups, 2, -1)
    sc = sc.permute(0, 3, 1, 2).reshape(blocks * LANES, 2 * groups)[:n]
    return codes.reshape(n, -1), _per_row(packed, at, n), sc


def int4_symmetric(packed: torch.Tensor) -> bool:
    """Whether weights packed by `pack_int4` are in a symmetric layout (no offsets)."""
    return packed.shape[-1] in (INT4_SYM_BYTES, INT4_SYM_BYTES + INT5_HIGH_BYTES)


def int5(packed: torch.Tensor) -> bool:
    """Whether weights packed by `pack_int4` hold 5-bit codes (a plane of fifth bits)."""
    return packed.shape[-1] in (INT4_BYTES + INT5_HIGH_BYTES, INT4_SYM_BYTES + INT5_HIGH_BYTES)


def group_codes(nibbles: torch.Tensor, high: torch.Tensor | None) -> torch.Tensor:
    """Codes uint8 [.., 32] of a row's group from its nibble bytes [.., 16] and, in a 5-bit
    layout, its 4 fifth-bit bytes [.., 4] as the kernel stores them."""
    codes = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    return codes if high is None else codes | _plane_bits(high) << 4


def unpack_int4(
    packed: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `pack_int4`: codes uint8 [n, K], fp16 scale and offset [n, K / 32]
    (offset None for a symmetric layout)."""
    five = int5(packed)
    high = _deinterleave(packed, 4, n, INT4_CODE_BYTES) if five else None
    codes = group_codes(_deinterleave(packed, BLOCK // 2, n), high).reshape(n, -1)
    at = INT4_CODE_BYTES + (INT5_HIGH_BYTES if five else 0)
    offset = None if int4_symmetric(packed) else _per_row(packed, at + 2 * LANES, n)
    return codes, _per_row(packed, at, n), offset


def build_key(cxx: str, flags: list[str]) -> str:
    """The kernel cache folder's key: the sources, the compiler, torch, the flags and the
    variants. The same in every process (the CPU flag sets are sorted: a frozenset's repr
    follows the per-process string hash, and a key built from it rebuilt the kernels
    in every new process)."""
    texts = [p.read_text() for p in (*KERNEL_SOURCES, BINDING, *HEADERS)]
    variants = [(name, cflags, sorted(needs)) for name, (cflags, needs) in VARIANTS.items()]
    text = "\0".join([*texts, cxx, torch.__version__, " ".join(flags), repr(variants)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def build(namespace: str = "lmforge", folder: Path | None = None) -> NativeKernels:
    """Compile every variant and the torch binding as the torch op namespace `namespace`, into
    `folder` (default the kernel cache), and load them, running `pick_variant()`; a build
    already there is loaded as it is. Raises RuntimeError with the compiler's first complaint
    when the build fails."""
    from torch.utils import cpp_extension

    if not namespace.isidentifier():  # it becomes a C++ namespace and a torch.ops attribute
        raise ValueError(f"op namespace must be an identifier, got {namespace!r}")
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH")
    flags = ["-O3", "-fopenmp", "-std=c++17", f"-DLMFORGE_NS={namespace}"]
    name = f"{namespace}_kernels_{build_key(cxx, flags)}"
    directory = (folder or cache_root() / "kernels") / name
    try:  # a read-only or full cache folder fails here too: one line, torch's kernels stay
        directory.mkdir(parents=True, exist_ok=True)
        objects = _compile_variants(cxx, directory)
        cpp_extension.load(name=name, sources=[str(BINDING)], extra_cflags=flags,
                           extra_include_paths=[str(NATIVE)],
                           extra_ldflags=[*map(str, objects), "-fopenmp"],
                           build_directory=str(directory), is_python_module=False,
                           verbose=False)  # fmt: skip
    except Exception as error:  # noqa: BLE001 - any failure: keep torch's kernels, say why
        text = str(error).splitlines()  # the compiler's diagnostic first, else torch's summary
        lines = [ln for ln in text if "error:" in ln] or [
            ln for ln in text if "error" in ln.lower()] or [str(error)]  # fmt: skip
        why = lines[0].strip()[:300]
        raise RuntimeError(f"building the native kernels failed: {why}") from None
    if namespace not in _fakes:  # output shapes, for tracing (torch.export, AOTInductor)
        _fakes.add(namespace)
        for op in ("int8_matmul", "int4_matmul", "q8_matmul"):
            torch.library.register_fake(f"{namespace}::{op}")(_fake_matmul)
        torch.library.register_fake(f"{namespace}::dequantize_int4")(_fake_dequant_int4)
        torch.library.register_fake(f"{namespace}::dense_matmul")(_fake_dense)
        torch.library.register_fake(f"{namespace}::decode_attention")(_fake_attention)
        torch.library.register_fake(f"{namespace}::prefill_attention")(_fake_prefill)
        torch.library.register_fake(f"{namespace}::silu_mul")(_fake_silu_mul)
        for op, fake in _ROW_FAKES.items():
            torch.library.register_fake(f"{namespace}::{op}")(fake)
    kernels = NativeKernels(namespace)
    if kernels.variants() != list(VARIANTS):
        raise RuntimeError(f"kernels.h lists {kernels.variants()}, VARIANTS {list(VARIANTS)}")
    kernels.use(pick_variant())
    return kernels


def _compile_variants(cxx: str, directory: Path) -> list[Path]:
    """Each kernel source compiled once per variant (its -m flags, -DLMFORGE_VARIANT=name) into
    `directory`, in parallel; the objects already there are kept (the folder's name is the
    sources' key). Raises RuntimeError with the compiler's output on a failure."""

    def compile_one(job: tuple[str, Path]) -> Path:
        variant, source = job
        obj = directory / f"{variant}_{source.stem}.o"
        if obj.exists():
            return obj
        part = obj.with_suffix(".o.part")
        cmd = [cxx, "-O3", "-fopenmp", "-fPIC", "-std=c++17", *VARIANTS[variant][0],
               f"-DLMFORGE_VARIANT={variant}", "-c", str(source), "-o", str(part)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{source.name} ({variant}): {done.stderr or done.stdout}")
        part.replace(obj)
        return obj

    jobs = [(v, s) for v in VARIANTS for s in KERNEL_SOURCES]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(compile_one, jobs))


def _fake_matmul(x, packed, *scale_and_n):
    return x.new_empty(x.shape[0], scale_and_n[-1])


def _fake_dequant_int4(packed, n, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    return packed.new_empty(n, packed.shape[1] * BLOCK, dtype=dtype)


def _fake_dense(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _fake_attention(q, k, v, mask):
    return q.new_empty(q.shape)


def _fake_prefill(q, k, v):
    b, h, t, d = q.shape
    return q.new_empty(b, t, h, d).transpose(1, 2)


def _fake_silu_mul(gate, up, bf16):
    return gate.new_empty(gate.shape, dtype=torch.bfloat16 if bf16 else torch.float32)


_ROW_FAKES = {  # row_ops.cpp's
    "rms_norm": lambda x, w, eps: x.new_empty(x.shape),
    "argmax_rows": lambda x: x.new_empty(x.shape[0], dtype=torch.long),
    "rope_rotate_half": lambda x, cos, sin: x.new_empty(x.shape),
}

_failures: list[str] = []  # why the build failed, for describe_kernels and the tests


@functools.cache
def native_kernels() -> NativeKernels | None:
    """The kernels, built on first call and running this CPU's variant; None where they cannot
    be (no compiler, a failed build, LMFORGE_NATIVE_KERNELS=0): callers keep torch's kernels."""
    try:
        if os.environ.get("LMFORGE_NATIVE_KERNELS", "1") == "0":
            raise RuntimeError("LMFORGE_NATIVE_KERNELS=0")
        return build()
    except RuntimeError as error:
        _failures.append(str(error))
        return None


def unavailable_reason() -> str:
    """Why native_kernels() returned None ('' when it did not, or has not been asked)."""
    return _failures[0] if _failures else ""
