"""The native kernels (lmforge/infer/native/): the int8 / int4 / Q8_0 products in every
instruction-set variant this CPU runs, against torch on the same quantised activations; the
fallbacks, the layouts, the choice of variant; the decode attention (decode_attention.cpp)
against torch's SDPA; SwiGLU's silu(gate) * up (activations.cpp), RMSNorm, RoPE and the greedy
argmax (row_ops.cpp) against torch's."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from lmforge.infer import cpu_kernels
from lmforge.infer.cpu_features import cpu_features
from lmforge.infer.int4_linear import Int4Linear, quantize_int4
from lmforge.infer.quantized_linear import Int8Linear

pytestmark = pytest.mark.skipif(
    cpu_kernels.native_kernels() is None,
    reason=f"no native kernels: {cpu_kernels.unavailable_reason()}",
)


def _variants() -> list[str]:
    """The variants this CPU runs (on an AVX-512 machine also the AVX2 and portable ones, so
    that one machine checks the code of every slower x86-64 too)."""
    f = cpu_features()
    return cpu_kernels.runnable_variants(f.flags, f.machine)


@pytest.fixture(params=_variants())
def kernel(request) -> cpu_kernels.NativeKernels:
    """The library running one variant; this CPU's own again afterwards."""
    kernels = cpu_kernels.native_kernels()
    mine = kernels.variant
    kernels.use(request.param)
    yield kernels
    kernels.use(mine)


def quantised_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: int8 per block of 32 (absmax / 127, round to nearest even)."""
    blocks = x.view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks))
    return (q * d).view_as(x)


# rows: 1 to 9 cover the 4-row tiles of x and the tails after them
@pytest.mark.parametrize("rows", [1, 3, 6, 9])
@pytest.mark.parametrize("shape", [(70, 96), (36, 64), (16, 32)])  # n % 16: 6, 4 and none
def test_int8_matches_torch_on_the_same_quantised_activations(kernel, rows, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows * n)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) / 50
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 4, k)  # uneven blocks
    packed = cpu_kernels.pack_int8(w)
    assert torch.equal(cpu_kernels.unpack_int8(packed, n), w)
    padded = torch.cat([scale, scale.new_zeros(packed.shape[0] * 16 - n)])
    y = kernel.int8_matmul(x, packed, padded, n)
    expect = quantised_activations(x) @ (w.float() * scale[:, None]).t()
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-5)
    unquantised = x @ (w.float() * scale[:, None]).t()
    assert (y - unquantised).norm() / unquantised.norm() < 1e-2


@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("shape", [(70, 96), (36, 64)])  # odd and even numbers of groups
def test_int4_matches_torch_on_the_same_quantised_activations(kernel, rows, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows + n)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) / 20).half()
    m = (torch.randn(n, k // 32, generator=g) / 5).half()
    x = torch.randn(rows, k, generator=g)
    scaled = (q.float().view(n, -1, 32) * d.float()[..., None]).view(n, k)
    packed = cpu_kernels.pack_int4(q, d, m)
    y = kernel.int4_matmul(x, packed, n)
    # the centred scaled codes meet the quantised activations; the offsets (with the centring's
    # 8 d) the exact group sums
    centred = ((q.float() - 8).view(n, -1, 32) * d.float()[..., None]).view(n, k)
    expect = (
        quantised_activations(x) @ centred.t()
        + x.view(rows, -1, 32).sum(-1) @ (m.float() + 8 * d.float()).t()
    )
    torch.testing.assert_close(y, expect, rtol=1e-4, atol=1e-4)
    w = scaled + m.float().repeat_interleave(32, dim=1)
    assert (y - x @ w.t()).norm() / (x @ w.t()).norm() < 2e-2
    codes, d2, m2 = cpu_kernels.unpack_int4(packed, n)
    assert torch.equal(codes, q.to(torch.uint8)) and torch.equal(d2, d) and torch.equal(m2, m)
    torch.testing.assert_close(kernel.dequantize_int4(packed, n, torch.float32), w)


@pytest.mark.parametrize("rows", [1, 5, 8])
@pytest.mark.parametrize("shape", [(70, 96), (36, 64)])
@pytest.mark.parametrize("bits", [4, 5])
def test_symmetric_int4_is_the_int4_kernel_with_the_offset_minus_8_scale(kernel, rows, shape,
                                                                         bits):  # fmt: skip
    """The symmetric layouts (llama.cpp's Q4_0: w = (q - 8) d, Q5_0: w = (q - 16) d, no offsets
    stored) against the fp32 product on the same quantised activations, and bit for bit
    against the asymmetric layout holding m = -8 d or -16 d (exact in fp16), whose offset term
    is then zero."""
    n, k = shape
    centre = 1 << bits - 1
    g = torch.Generator().manual_seed(rows + n + 2)
    q = torch.randint(0, 2 * centre, (n, k), generator=g)
    d = (torch.randn(n, k // 32, generator=g) / 20).half()  # Q4_0's d takes either sign
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 4, k)
    packed = cpu_kernels.pack_int4(q, d)
    high = cpu_kernels.INT5_HIGH_BYTES if bits == 5 else 0
    assert packed.shape[-1] == cpu_kernels.INT4_SYM_BYTES + high
    assert cpu_kernels.int4_symmetric(packed) and cpu_kernels.int5(packed) == (bits == 5)
    codes, d2, m2 = cpu_kernels.unpack_int4(packed, n)
    assert torch.equal(codes, q.to(torch.uint8)) and torch.equal(d2, d) and m2 is None
    w = ((q.float() - centre).view(n, -1, 32) * d.float()[..., None]).view(n, k)
    y = kernel.int4_matmul(x, packed, n)
    torch.testing.assert_close(y, quantised_activations(x) @ w.t(), rtol=1e-4, atol=1e-4)
    asymmetric = cpu_kernels.pack_int4(q, d, -centre * d)
    assert asymmetric.shape[-1] == cpu_kernels.INT4_BYTES + high
    assert torch.equal(y, kernel.int4_matmul(x, asymmetric, n))
    assert torch.equal(kernel.dequantize_int4(packed, n, torch.float32), w)
    assert torch.equal(kernel.dequantize_int4(asymmetric, n, torch.float32), w)
    assert torch.equal(kernel.dequantize_int4(packed, n, torch.bfloat16), w.bfloat16())


def write_one_tensor(path, blocks: np.ndarray, qtype):
    """A GGUF file holding one tensor "w" of `qtype` blocks (gguf-py's writer)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("kind", "bits"), [("Q4_0", 4.5), ("Q4_1", 5), ("Q5_0", 5.5), ("Q5_1", 6)])
def test_gguf_q4_q5_run_as_stored_on_every_variant(kernel, tmp_path, kind, bits):
    """Oracle gguf-py: its quantiser writes a Q4_0 / Q4_1 / Q5_0 / Q5_1 tensor and its
    dequantiser reads it back; the blocks repacked as stored (no offsets for Q4_0 / Q5_0, fifth
    bits for Q5: the file's bits a weight) give those weights bit for bit (the kernel's
    dequantisation and the embedding's row lookup) and their product at decode and prefill
    sizes; the first three rows again in fp32 against the fp32 product of the raw x."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    from lmforge.interop.gguf_blocks import read_group_blocks
    from lmforge.interop.gguf_read import GGUFFile

    qtype = gguf.GGMLQuantizationType[kind]
    w = np.random.default_rng(1).standard_normal((40, 96)).astype(np.float32)
    f = GGUFFile(write_one_tensor(tmp_path / "q.gguf", quantize(w, qtype), qtype))
    theirs = torch.from_numpy(np.array(dequantize(f.blocks("w"), qtype), dtype=np.float32))
    nibbles, d, m, high = read_group_blocks(f, "w")
    assert (m is None) == kind.endswith("_0") and (high is None) == kind.startswith("Q4")
    layer = Int4Linear.from_q4_blocks(nibbles, d, m, dtype=torch.float32, name="w", high=high)
    assert layer.symmetric == kind.endswith("_0") and layer.bits == (5 if high is not None else 4)
    packed = layer._buffers["native_packed"]
    assert packed.numel() == 48 * 96 * bits / 8  # the file's bits a weight (48 padded rows)
    assert torch.equal(layer.dequantize(), theirs)
    assert torch.equal(layer.rows(torch.tensor([0, 17, 39, 17])), theirs[[0, 17, 39, 17]])
    # Q4_1 / Q5_1's offsets (with the centring's 8 d / 16 d) meet the exact group sums of x
    offset = torch.zeros(40, 3) if m is None else m.float() + layer.centre * d.float()
    centred = theirs - offset.repeat_interleave(32, dim=1)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(0))
    for rows in (1, 3, 40):  # a decode step, a tile's tail, a prompt
        expect = (quantised_activations(x[:rows]) @ centred.t()
                  + x[:rows].view(rows, 3, 32).sum(-1) @ offset.t())  # fmt: skip
        torch.testing.assert_close(layer(x[:rows]), expect, rtol=1e-4, atol=1e-4)
    exact = x[:3].double() @ theirs.double().t()
    assert ((layer(x[:3]) - exact).norm() / exact.norm()) < 1e-2
    f.close()
    with pytest.raises(Exception, match="not Q4_0 or Q4_1 or Q5_0 or Q5_1"):
        read_group_blocks(GGUFFile(write_one_tensor(tmp_path / "f.gguf", w, None)), "w")


def test_gguf_q6_k_runs_as_stored_on_every_variant(kernel, tmp_path):
    """Oracle gguf-py's dequantisation (it cannot quantise to Q6_K: random blocks with small fp16
    d of either sign): the int6 layout holds those weights bit for bit (7 bits a weight), and
    multiplies them as the fp32 product on the same quantised activations, decode and prefill."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    from lmforge.infer.int4_linear import Int6Linear
    from lmforge.interop.gguf_blocks import read_q6_k_blocks
    from lmforge.interop.gguf_read import GGUFFile

    q6_k = gguf.GGMLQuantizationType.Q6_K
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, (40, 2, 210), dtype=np.uint8)
    d = (rng.standard_normal((40, 2, 1)) * 1e-4).astype(np.float16)
    raw[..., 208:] = d.view(np.uint8)
    f = GGUFFile(write_one_tensor(tmp_path / "q6.gguf", raw.reshape(40, -1), q6_k))
    theirs = torch.from_numpy(np.array(dequantize(f.blocks("w"), q6_k), dtype=np.float32))
    layer = Int6Linear(*read_q6_k_blocks(f, "w"))
    packed = layer._buffers["native_packed"]
    assert packed.numel() == 48 * 512 * 7 // 8  # 7 bits a weight (48 padded rows)
    assert torch.equal(layer.dequantize(), theirs)
    assert torch.equal(layer.dequantize(17, 35), theirs[17:35])
    assert torch.equal(layer.rows(torch.tensor([0, 17, 39, 17])), theirs[[0, 17, 39, 17]])
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(0))
    for rows in (1, 3, 40):  # a decode step, a tile's tail, a prompt
        torch.testing.assert_close(layer(x[:rows]), quantised_activations(x[:rows]) @ theirs.t(),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip
    f.close()


# rows: 1 (one weight row at a time), 3 and 5 (the tiles of x and their tails), 13 and 20 (fp32
# weights on AVX-512: tiles of 3 rows against 4 of the 37 rows of weights, then single rows; the
# 16-bit GEMM's partial tiles: of one vector of rows at 13 on AVX-512, of two at 20), 40 (the
# GEMM: a whole tile of 32 (AVX-512) or 16 (AVX2) rows of x and a part; its 37 weight rows: 3
# tiles of 12 (6 of 6) and 1); k = 200 leaves a tail
# after the last whole vector of every width, k = 1,500 splits fp32 weights into two blocks of
# columns (768 + 732) and the GEMM's into three (500)
@pytest.mark.parametrize("rows", [1, 3, 5, 13, 20, 40])
@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("activations", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [200, 1500])
def test_dense_matmul_matches_torch_in_float64(kernel, rows, weights, activations, k):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(37, k, generator=g).to(weights)
    x = torch.randn(rows, k, generator=g).to(activations)
    y = kernel.dense_matmul(x, w)
    assert y.dtype == activations and y.shape == (rows, 37)
    # the same weights and the same activations, multiplied and summed exactly by torch; bf16
    # outputs are rounded
    expect = x.double() @ w.double().t()
    tol = 2e-5 if activations == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), expect, rtol=tol, atol=tol * expect.abs().max().item())


@pytest.mark.parametrize("weights", [torch.float16, torch.bfloat16])
def test_dense_matmul_gemm_takes_rows_in_passes(kernel, weights):
    """More rows of x than one pass of the GEMM holds (256): the passes and the tail tile."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(13, 96, generator=g).to(weights), torch.randn(300, 96, generator=g)
    expect = x.double() @ w.double().t()
    torch.testing.assert_close(kernel.dense_matmul(x, w).double(), expect, rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("k", [576, 1536])  # SmolLM2's: one block of columns and two
def test_dense_matmul_sums_a_row_alike_in_any_batch(kernel, k):
    """A row's outputs are bit-identical whether it is multiplied alone or among 1-15 others
    (its sum runs in one order in every tile of rows): a sequence decodes alike in any batch."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(50, k, generator=g), torch.randn(16, k, generator=g)
    alone = torch.cat([kernel.dense_matmul(x[i : i + 1], w) for i in range(16)])
    for rows in (2, 5, 8, 13, 16):
        assert torch.equal(kernel.dense_matmul(x[:rows], w), alone[:rows])


def test_dense_matmul_bf16_sums_a_row_alike_in_any_large_batch(kernel):
    """bf16 activations and weights above 10 rows (AVX512-BF16: the bf16 tile; elsewhere the
    GEMM): a row's outputs are the same bits among 11 or 40 rows."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 576, generator=g).bfloat16()
    x = torch.randn(40, 576, generator=g).bfloat16()
    every = kernel.dense_matmul(x, w)
    for lo, hi in ((0, 11), (3, 19), (20, 40)):
        assert torch.equal(kernel.dense_matmul(x[lo:hi], w), every[lo:hi])


def test_dense_matmul_rejects_weights_it_cannot_read(kernel):
    x = torch.randn(1, 64)
    for w in (torch.randn(8, 64).double(), torch.randn(64, 8).to(torch.bfloat16).t()):
        with pytest.raises(RuntimeError, match="contiguous 2-d CPU bf16, fp16 or fp32"):
            kernel.dense_matmul(x, w)
    with pytest.raises(RuntimeError, match="shapes"):
        kernel.dense_matmul(torch.randn(1, 32), torch.randn(8, 64).to(torch.bfloat16))


# (rows, heads, kv heads, head_dim, keys): GQA 3:1 at head_dim 64 (SmolLM2), MHA at 32, a
# head_dim no vector width divides (the scalar loop), one key, and query-head groups the value
# pass splits (5 = 4 + 1 at 64; 7 = 2 + 2 + 2 + 1 at 128; one head at a time at 256)
@pytest.mark.parametrize("shape", [(5, 9, 3, 64, 37), (2, 4, 4, 32, 20), (3, 6, 2, 40, 9),
                                   (1, 2, 1, 16, 1), (2, 10, 2, 64, 23), (2, 14, 2, 128, 19),
                                   (1, 4, 2, 256, 6)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_attention_matches_torch_sdpa(kernel, shape, dtype):
    b, h, kv, d, n = shape
    g = torch.Generator().manual_seed(b * n + d)
    q = torch.randn(b, h, 1, d, generator=g)
    # cache views as the engine passes them: the first rows and keys of larger buffers
    k_buf, v_buf = (torch.randn(b + 2, kv, n + 5, d, generator=g).to(dtype) for _ in range(2))
    k, v = k_buf[:b, :, :n], v_buf[:b, :, :n]
    mask = torch.rand(b, n, generator=g) > 0.4
    mask[:, -1] = True  # a row's own newest key is always there
    for m in (mask, None):
        y = kernel.decode_attention(q, k, v, m)
        sdpa_mask = None if m is None else m[:, None, None, :]
        expect = torch.nn.functional.scaled_dot_product_attention(
            q, k.float(), v.float(), attn_mask=sdpa_mask, enable_gqa=h != kv
        )
        torch.testing.assert_close(y, expect, rtol=1e-5, atol=2e-6)
    # a masked key's values never enter, however large
    y = kernel.decode_attention(q, k, v, mask)
    loud = v.clone()
    loud[(~mask)[:, None, :].expand(b, kv, n)] = 1e4
    assert torch.equal(kernel.decode_attention(q, k, loud, mask), y)


# (rows, heads, kv heads, head_dim, tokens): GQA 3:1 at head_dim 64 (SmolLM2) over 128 tokens
# and an odd count, MHA at 32, 128 wide, a head_dim no vector width divides (the scalar loop),
# one token, and a tile of 4 query rows that runs past a block's last position
@pytest.mark.parametrize("shape", [(1, 9, 3, 64, 128), (2, 9, 3, 64, 37), (2, 4, 4, 32, 20),
                                   (1, 4, 2, 128, 70), (2, 6, 2, 40, 9), (3, 2, 1, 64, 1),
                                   (1, 5, 5, 16, 17)])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_attention_matches_torch_sdpa(kernel, shape, threads):
    b, h, kv, d, t = shape
    g = torch.Generator().manual_seed(b * t + d)
    # views of one fused projection's heads, as CausalSelfAttention.project returns them
    heads = torch.randn(b, t, h + 2 * kv, d, generator=g).transpose(1, 2)
    q, k, v = heads[:, :h], heads[:, h : h + kv], heads[:, h + kv :]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = kernel.prefill_attention(q, k, v)
    finally:
        torch.set_num_threads(before)
    expect = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=h != kv
    )
    assert y.shape == (b, h, t, d) and y.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=2e-6)
    # a later key never enters an earlier query, however large
    loud = v.clone()
    loud[:, :, -1] = 1e4
    torch.testing.assert_close(kernel.prefill_attention(q, k, loud)[:, :, :-1], y[:, :, :-1])
    with pytest.raises(RuntimeError, match="prefill attention"):
        kernel.prefill_attention(q.double(), k, v)


# sizes: under one vector, a vector and a tail, several of the threads' chunks and a tail
@pytest.mark.parametrize("shape", [(1, 5), (3, 37), (2, 16384 + 77)])
def test_silu_mul_matches_torch(kernel, shape):
    g = torch.Generator().manual_seed(shape[1])
    gate, up = torch.randn(*shape, generator=g) * 8, torch.randn(*shape, generator=g)
    gate[0, :3] = torch.tensor([-200.0, 200.0, 0.0][: shape[1]])  # exp's clamps, silu(0) = 0
    expect = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(kernel.silu_mul(gate, up, False), expect, rtol=2e-6, atol=1e-6)
    # bf16 in (a bf16 GEMM's output) and out (the next one's input): one rounding of the fp32
    gb, ub = gate.bfloat16(), up.bfloat16()
    exact = torch.nn.functional.silu(gb.float()) * ub.float()
    y = kernel.silu_mul(gb, ub, True)
    assert y.dtype == torch.bfloat16 and torch.equal(kernel.silu_mul(gb, ub, False).bfloat16(), y)
    torch.testing.assert_close(y.float(), exact, rtol=2**-8, atol=1e-6)
    assert (y != exact.bfloat16()).float().mean() < 0.01  # rounded alike but for exp's last bit


# shapes: under one vector, a vector and a tail, enough rows for the threads' tasks
@pytest.mark.parametrize("shape", [(1, 7), (3, 37), (300, 576)])
def test_rms_norm_matches_torch(kernel, shape):
    g = torch.Generator().manual_seed(shape[1])
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[1], generator=g)
    torch.testing.assert_close(kernel.rms_norm(x, w, 1e-6), torch.rms_norm(x, w.shape, w, 1e-6))
    x[0] = 0  # a row of zeros: eps alone under the root
    torch.testing.assert_close(kernel.rms_norm(x, w, 1e-5)[0], torch.zeros(shape[1]))
    # bf16 activations, fp32 or bf16 weights: computed in fp32, rounded once (as F.rms_norm on
    # the upcast input, then .to(bf16))
    xb = x.bfloat16().view(shape[0], 1, -1)  # [..., d]: any leading dims
    for wb in (w, w.bfloat16()):
        y = kernel.rms_norm(xb, wb, 1e-6)
        exact = torch.rms_norm(xb.float(), w.shape, wb.float(), 1e-6)
        assert y.dtype == torch.bfloat16 and y.shape == xb.shape
        torch.testing.assert_close(y.float(), exact, rtol=2**-8, atol=1e-6)
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernel.rms_norm(x.double(), w, 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm"):
        kernel.rms_norm(x, w[:-1], 1e-6)


@pytest.mark.parametrize("head_dim", [6, 40, 64])  # half under a vector, with a tail, whole
def test_rope_rotate_half_gives_the_bits_of_torchs_ops(kernel, head_dim):
    """On the heads as the attention hands them over (a strided view of the fused projection),
    with per-row tables (a decode step) and shared ones (a prefill): the same bits as
    RotaryEmbedding's own torch ops, contiguous."""
    from lmforge.model.positions import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, 512)
    g = torch.Generator().manual_seed(head_dim)
    for b, t, positions in ((5, 1, torch.randint(0, 512, (5, 1), generator=g)),
                            (2, 33, torch.arange(33))):  # fmt: skip
        qkv = torch.randn(b, t, 10, head_dim, generator=g)
        qk = qkv.transpose(1, 2)[:, :8]  # q and k heads, not v's
        cos, sin = rope.tables(positions, torch.float32)
        y = kernel.rope_rotate_half(qk, cos, sin)
        assert y.is_contiguous() and torch.equal(y, rope.rotate(qk, cos, sin))
    with pytest.raises(RuntimeError, match="rope_rotate_half"):
        kernel.rope_rotate_half(qk.double(), cos, sin)


@pytest.mark.parametrize("n", [5, 37, 8192])  # under a vector, a tail, a vocabulary
def test_argmax_rows_picks_what_torch_max_picks(kernel, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    x[1, n // 2] = x[1, n - 1] = 9.0  # a tie: the first wins
    x[2] = float("-inf")  # every token masked: index 0
    x[3, n - 1] = float("nan")  # a NaN wins, as torch.max propagates it
    x[4, n // 3] = x[4, n // 2] = float("nan")  # the first NaN
    x[5, 0] = float("inf")
    assert torch.equal(kernel.argmax_rows(x), x.max(dim=-1).indices)


def test_layers_use_the_native_kernel_and_agree_with_their_own_weights():
    if cpu_kernels.native_kernels() is None:
        pytest.skip(f"native kernel unavailable: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(0)
    linear = nn.Linear(128, 48)
    x = torch.randn(2, 128)
    exact = linear(x).detach()
    int8 = Int8Linear(linear, torch.float32)
    int4 = Int4Linear(linear, torch.float32, 32)
    assert int8._native is not None and int4._native is not None
    for layer, tol in ((int8, 0.02), (int4, 0.1)):
        decode, prefill = layer(x), layer(x.repeat(8, 1))[:2]  # native GEMV, dequantising GEMM
        assert (decode - exact).norm() / exact.norm() < tol
        assert (decode - prefill).norm() / prefill.norm() < 0.02  # only the activations' int8
    twin = copy.deepcopy(int4)  # layers copy (the engine's callers may copy a model)
    assert twin._native is int4._native and torch.equal(twin(x), int4(x))
    q, scale, zero = quantize_int4(linear.weight, 32)
    w = ((q.float() - 8).view(48, -1, 32) * scale[..., None] + zero[..., None]).view(48, 128)
    torch.testing.assert_close(int4.dequantize(), w, rtol=1e-2, atol=2e-3)  # fp16 scales
    assert torch.equal(int4.unpacked_codes(), q.to(torch.uint8))


def test_layers_the_kernel_cannot_take_keep_torchs_kernels():
    torch.manual_seed(0)
    linear = nn.Linear(40, 16)  # 40 input features: not a multiple of 32
    x = torch.randn(1, 40)
    layer = Int8Linear(linear, torch.float32)
    assert layer._native is None
    expect = x @ layer.dequantize().t() + layer.bias
    assert (layer(x) - expect).norm() / expect.norm() < 1e-2
    # why Int8Linear avoids torch's int8 GEMV there: it reads past the rows at such widths
    w, s = layer.weight_int8, layer.kernel_scale
    wrong = [torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w, s) for _ in range(5)]
    if all(torch.allclose(y.float(), expect, rtol=2e-2, atol=0.1) for y in wrong):
        pytest.skip("this torch's _weight_int8pack_mm handles 40 inputs: the guard can go")
    assert Int4Linear(nn.Linear(128, 32), torch.float32, group_size=64)._native is None


def test_a_failed_build_says_why_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a 'compiler' that always fails
    with pytest.raises(RuntimeError, match="building the native kernels failed") as caught:
        cpu_kernels.build("lmforge_test_broken", tmp_path)
    assert "\n" not in str(caught.value)
    assert not list(tmp_path.glob("*/*.so"))
    blocked = tmp_path / "file"  # a cache "folder" that is a file: mkdir fails
    blocked.write_text("")
    monkeypatch.setenv("CXX", "c++")
    with pytest.raises(RuntimeError, match="building the native kernels failed"):
        cpu_kernels.build("lmforge_test_broken", blocked)
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpu_kernels.build("lmforge_test_broken", tmp_path)


ZEN3 = "fpu sse2 avx f16c fma avx2 bmi2"  # AVX2 only (an EPYC 7B13)
SAPPHIRE_RAPIDS = (ZEN3 + " avx512f avx512bw avx512vl avx512dq avx512cd avx512_vnni avx512_bf16"
                   " amx_bf16 amx_tile amx_int8")  # fmt: skip
SKYLAKE_X = ZEN3 + " avx512f avx512bw avx512vl avx512dq avx512cd"


@pytest.mark.parametrize(
    ("flags", "machine", "best"),
    [(ZEN3, "x86_64", "avx2"), (SAPPHIRE_RAPIDS, "x86_64", "avx512_bf16"),
     (SKYLAKE_X, "x86_64", "avx512"), ("sse2", "x86_64", "portable"),
     (SAPPHIRE_RAPIDS, "aarch64", "portable")],
)  # fmt: skip
def test_each_cpu_gets_the_best_variant_it_runs(flags, machine, best):
    runnable = cpu_kernels.runnable_variants(frozenset(flags.split()), machine)
    assert runnable[0] == best and runnable[-1] == "portable"
    assert list(cpu_kernels.VARIANTS).index(best) == len(cpu_kernels.VARIANTS) - len(runnable)


def test_one_library_holds_every_variant_and_runs_this_cpus(monkeypatch):
    kernels = cpu_kernels.native_kernels()
    assert kernels.variants() == list(cpu_kernels.VARIANTS)
    assert kernels.variant == cpu_kernels.pick_variant()
    monkeypatch.setenv("LMFORGE_KERNEL_VARIANT", "portable")
    assert cpu_kernels.pick_variant() == "portable"
    monkeypatch.setenv("LMFORGE_KERNEL_VARIANT", "no_such_isa")
    with pytest.raises(RuntimeError, match="this CPU runs"):
        cpu_kernels.pick_variant()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LMFORGE_NATIVE_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_failures", [])
    cpu_kernels.native_kernels.cache_clear()
    try:
        assert cpu_kernels.native_kernels() is None
        assert cpu_kernels.unavailable_reason() == "LMFORGE_NATIVE_KERNELS=0"
    finally:
        cpu_kernels.native_kernels.cache_clear()


@pytest.mark.parametrize("symmetric", [False, True])
def test_an_int4_layer_moved_off_the_cpu_dequantises_with_torch_ops(symmetric):
    """The native layouts stay usable where the CPU kernel cannot run (here the meta device
    stands in for a GPU): dequantise in torch ops, multiply with the GEMM."""
    if symmetric:  # Q4_0 blocks: no offsets
        g = torch.Generator().manual_seed(0)
        nibbles = torch.randint(0, 256, (40, 3, 16), dtype=torch.uint8, generator=g)
        layer = Int4Linear.from_q4_blocks(nibbles, (torch.rand(40, 3, generator=g) / 9).half())
    else:
        layer = Int4Linear(nn.Linear(96, 40), torch.float32, 32)
    if layer._native is None:
        pytest.skip("native kernel unavailable")
    assert layer.symmetric == symmetric
    on_cpu = layer.dequantize()
    moved = layer.to("meta")
    assert moved.dequantize().shape == on_cpu.shape and moved.dequantize().device.type == "meta"
    assert moved(torch.randn(1, 96, device="meta")).shape == (1, 40)


@pytest.mark.parametrize("rows", [1, 3, 6, 9])
@pytest.mark.parametrize("shape", [(70, 96), (36, 64), (16, 32)])
def test_q8_matches_torch_on_the_same_quantised_activations(kernel, rows, shape):
    """llama.cpp's Q8_0 blocks (fp16 scale per row and 32 inputs) through the q8 kernel."""
    n, k = shape
    g = torch.Generator().manual_seed(rows * n + 1)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) / 50).half()
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 4, k)
    packed = cpu_kernels.pack_q8(q, d)
    codes, scales = cpu_kernels.unpack_q8(packed, n)
    assert torch.equal(codes, q) and torch.equal(scales, d)
    w = (q.float().view(n, -1, 32) * d.float()[..., None]).view(n, k)
    y = kernel.q8_matmul(x, packed, n)
    torch.testing.assert_close(y, quantised_activations(x) @ w.t(), rtol=1e-4, atol=1e-4)
    assert (y - x @ w.t()).norm() / (x @ w.t()).norm() < 2e-2


def test_block_int8_layer_is_llama_cpps_q8_0():
    """BlockInt8Linear quantises as gguf-py's Q8_0 quantiser does (the oracle) and its forward
    (native q8 kernel) agrees with its own dequantised weights."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize

    from lmforge.infer.quantized_linear import BlockInt8Linear

    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    layer = BlockInt8Linear(linear)
    w = linear.weight.detach().numpy()
    q8 = gguf.GGMLQuantizationType.Q8_0
    theirs = torch.from_numpy(dequantize(quantize(w, q8), q8).copy())
    assert torch.equal(layer.dequantize(), theirs)
    x = torch.randn(3, 96)
    expect = x @ theirs.t() + linear.bias.detach()
    assert layer._native is not None
    assert (layer(x) - expect).norm() / expect.norm() < 1e-2
