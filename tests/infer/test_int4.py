"""int4 weight-only quantisation: the Linear against its own dequantised weights (decode kernel
and prefill GEMM), shape errors, the engine against fp32, GGUF Q4_0/Q4_1 codes against gguf-py's
own dequantiser, and (real_model) the perplexity of int8/int4 SmolLM2 against fp32."""

import copy

import pytest
import torch
from torch import nn

from lmforge.errors import ConfigError
from lmforge.infer.engine import Engine, GenerationParams
from lmforge.infer.int4_linear import Int4Linear, quantize_int4
from lmforge.infer.quantize import to_inference_precision
from lmforge.infer.quantized_linear import Int8Linear, QuantizedLinear
from lmforge.lm import LM
from lmforge.model.config import ModelConfig


def reference(linear: nn.Linear, group_size: int, fp16_scales: bool = False) -> torch.Tensor:
    """The int4 weights; `fp16_scales`: as the native kernel stores them (w = q * d + m, d and m
    rounded to fp16)."""
    q, scale, zero = quantize_int4(linear.weight, group_size)
    n, k = q.shape
    if fp16_scales:
        d, m = scale.half().float(), (zero - 8 * scale).half().float()
        return (q.float().view(n, -1, group_size) * d[..., None] + m[..., None]).view(n, k)
    w = (q.float().view(n, -1, group_size) - 8) * scale[..., None] + zero[..., None]
    return w.view(n, k)


def test_quantize_int4_error_is_at_most_half_a_step():
    w = torch.randn(8, 128) * torch.logspace(-3, 1, 8)[:, None]  # rows of very different size
    q, scale, zero = quantize_int4(w, 32)
    assert q.dtype == torch.uint8 and int(q.max()) == 15 and int(q.min()) == 0
    deq = (q.float().view(8, 4, 32) - 8) * scale[..., None] + zero[..., None]
    assert bool(((deq - w.view(8, 4, 32)).abs() <= scale[..., None] / 2 * 1.001 + 1e-7).all())


# rows below gemm_rows run torch's int4 kernel (bf16 inputs), from gemm_rows the dequantised GEMM;
# 97 outputs are padded to 128 for the kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features, group_size", [(97, 32), (64, 64), (160, 128)])
def test_int4_linear_matches_its_dequantised_weights(rows, dtype, out_features, group_size):
    torch.manual_seed(0)
    linear = nn.Linear(256, out_features)
    m = Int4Linear(linear, dtype, group_size)
    w = reference(linear, group_size, fp16_scales=m._native is not None)
    exact = 1e-6 if m._native is not None else 0  # the kernel's fused multiply-add
    assert torch.allclose(
        m.dequantize().float(), w, atol=1e-2 if dtype == torch.bfloat16 else exact
    )
    x = torch.randn(2, rows, 256)
    out = m(x.to(dtype))
    assert out.shape == (2, rows, out_features) and out.dtype == dtype
    ref = x @ w.T + linear.bias
    # the decode kernel sees bf16-rounded inputs and scales: ~2^-8 relative
    tol = 0.02 * ref.abs().max()
    assert (out.float() - ref).abs().max() < tol
    if m._native is None and rows >= m.gemm_rows and dtype == torch.float32:  # fp32 GEMM
        assert torch.allclose(out, ref, atol=1e-4)


def test_gemm_chunks_cover_every_output_row():
    torch.manual_seed(0)
    linear = nn.Linear(64, 1000, bias=False)
    m = Int4Linear(linear, torch.float32, 32)
    m.chunk_weights = 64 * 96  # 96 rows per chunk: 11 chunks, the last one partial
    x = torch.randn(m.gemm_rows + 1, 64)
    w = reference(linear, 32, fp16_scales=m._native is not None)
    assert torch.allclose(m.gemm(x), x @ w.T, atol=1e-4)
    q8 = Int8Linear(linear, torch.float32)
    q8.chunk_weights = 64 * 96
    assert torch.allclose(q8.gemm(x), x @ q8.dequantize().T, atol=1e-4)


def test_bad_shapes_name_the_layer_and_a_group_size():
    with pytest.raises(ConfigError, match=r"layer blocks\.0\.up has in_features=96.*group size 32"):
        Int4Linear(nn.Linear(96, 32), group_size=64, name="blocks.0.up")
    with pytest.raises(ConfigError, match="no int4 group size divides it"):
        Int4Linear(nn.Linear(100, 32), name="head")
    with pytest.raises(ConfigError, match="group size must be one of"):
        Int4Linear(nn.Linear(96, 32), group_size=48)
    config = ModelConfig.from_preset("llama-micro", vocab_size=97, max_seq_len=64)
    model = LM.from_config(config, seed=0).model
    # d_model 128: group 256 does not divide it; the first Linear is named, nothing converted
    with pytest.raises(ConfigError, match=r"layer blocks\.0\.attn\.qkv_proj .*use group size 128"):
        to_inference_precision(model, quantize="int4", group_size=256)


def test_int4_engine_computes_its_dequantised_model():
    """The engine's forward equals the fp32 model with the int4 weights put back (exactly through
    the dequantised GEMM; to int8-activation rounding through lmforge's kernel); decoding picks
    that model's greedy tokens; and the int4 model stays near the original (random weights, no
    structure for int4 to keep: an RMS bound, not the max)."""
    config = ModelConfig.from_preset("llama-micro", vocab_size=97, max_seq_len=64)
    lm = LM.from_config(config, seed=0)
    ids = torch.randint(0, 97, (4, 40), generator=torch.Generator().manual_seed(0))
    engine = Engine(lm.model, max_batch=4, eos_ids=[], dtype="float32", quantize="int4")
    assert engine.precision == "int4 weights, float32 activations"
    assert isinstance(engine.model.blocks[0].mlp.down_proj, Int4Linear)
    assert isinstance(engine.model.lm_head, Int8Linear)  # the head stays at 8 bits
    back = LM.from_config(config, seed=0)
    with torch.no_grad():
        for name, m in engine.model.named_modules():
            if isinstance(m, (Int4Linear, Int8Linear)):
                back.model.get_submodule(name).weight.copy_(m.dequantize())
    with torch.inference_mode():
        ref, out, orig = back.model(ids), engine.model(ids), lm.model(ids)
    if engine.model.lm_head._native is None:  # the dequantised GEMM: the same model exactly
        assert torch.allclose(out, ref, atol=1e-4 * ref.abs().max())
    else:  # lmforge's kernel prefills too, on activations quantised to int8 per 32
        assert ((out - ref).pow(2).mean().sqrt() / ref.std()) < 0.03
    assert ((out - orig).pow(2).mean().sqrt() / orig.std()) < 0.3
    params = GenerationParams(max_new_tokens=4, temperature=0.0)
    prompts = ids[:, :12].tolist()
    ours = [c.token_ids for c in engine.generate(prompts, params)]
    theirs = Engine(back.model, max_batch=4, eos_ids=[]).generate(prompts, params)
    assert sum(a == b.token_ids for a, b in zip(ours, theirs)) >= 3


@pytest.mark.real_model
def test_smollm2_int8_int4_perplexity_close_to_fp32(smollm2_gguf):
    """~10k tokens of builtin:pydoc, window 1024, stride 512 (fp32 measured 11.34): int8 within
    1%, int4 within 3% of fp32, both through the prefill path (dequantised fp32 GEMMs) and
    through the decode GEMV (where the native kernel quantises the activations to int8). int4
    keeps the file's Q4_1 codes and quantises only the tied head (Q8_0 in the file); 'int4 ours'
    quantises every layer from the dequantised weights; 'as stored' is LM.load's default (the
    Q4_1 blocks and the Q8_0 table and head as they are in the file)."""
    from lmforge.data import read_documents
    from lmforge.eval.perplexity import perplexity

    lm = LM.load(smollm2_gguf, dtype="float32")
    tok = lm.tokenizer
    ids: list[int] = []
    for doc in read_documents("builtin:pydoc"):
        ids += tok.encode(doc) + [tok.eos_id]
        if len(ids) >= 10240:
            break
    ids, table = ids[:10240], tok.token_byte_lengths()
    int4 = LM.load(smollm2_gguf, dtype="float32", quantize="int4").model
    stored = LM.load(smollm2_gguf).model
    name = "blocks.0.mlp.down_proj"
    weight = lm.model.get_submodule(name).weight
    for model in (int4, stored):  # Q4_1 -> int4 loses nothing
        assert torch.equal(model.get_submodule(name).dequantize(), weight)
    models = {
        "fp32": lm.model,
        "int8": to_inference_precision(lm.model, "float32", "int8"),
        "int4": int4,
        "int4 ours": to_inference_precision(lm.model, "float32", "int4"),
        "as stored": stored,
    }
    for mode in ("int8", "int4"):  # every product through the decode GEMV (native: int8 x)
        models[f"{mode} gemv"] = copy.deepcopy(models[mode])
        for layer in models[f"{mode} gemv"].modules():
            if isinstance(layer, QuantizedLinear):
                layer.gemm_rows = 1 << 30
    ppl = {k: perplexity(m, ids, table, 1024, 512).perplexity for k, m in models.items()}
    print(" ".join(f"{k}: {v:.4f}" for k, v in ppl.items()))
    assert abs(ppl["int8 gemv"] / ppl["fp32"] - 1) < 0.01  # measured 11.35 (+0.8%, Zen 4)
    assert abs(ppl["int4 gemv"] / ppl["fp32"] - 1) < 0.03  # measured 11.41 (+1.2%)
    assert abs(ppl["fp32"] - 11.34) < 0.2
    assert abs(ppl["int8"] / ppl["fp32"] - 1) < 0.01
    assert abs(ppl["int4"] / ppl["fp32"] - 1) < 0.03
    assert abs(ppl["int4 ours"] / ppl["fp32"] - 1) < 0.03
    assert abs(ppl["as stored"] / ppl["fp32"] - 1) < 0.01
