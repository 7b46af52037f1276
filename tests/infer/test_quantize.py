"""Inference precision: int8 weight-only Linear (both kernels), conversion, byte counts, and
the quantised / bf16 engine against fp32 (logit error, teacher-forced greedy agreement)."""

import pytest
import torch
from torch import nn

from lmforge.errors import ConfigError
from lmforge.infer.cpu_kernels import native_kernels
from lmforge.infer.engine import Engine, GenerationParams
from lmforge.infer.quantize import (
    SwiGLU,
    decode_bytes,
    inference_model,
    resolve_dtype,
    to_inference_precision,
    weight_bytes,
)
from lmforge.infer.quantized_linear import HalfLinear, Int8Linear, quantize_int8
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.model.mlp import GatedMLP


def test_quantize_int8_rounds_each_row_to_its_own_scale():
    w = torch.randn(6, 32) * torch.logspace(-3, 1, 6)[:, None]  # rows of very different size
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert torch.allclose(scale, w.abs().amax(1) / 127)
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-7).all())


@pytest.mark.parametrize("rows", [1, 3, 8, 40])  # int8 GEMV below gemm_rows, bf16 GEMM above
def test_int8_linear_matches_its_dequantised_weights(rows):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    q8 = Int8Linear(linear)
    x = torch.randn(2, rows, 64)
    q, scale = quantize_int8(linear.weight)
    ref = x @ (q.float() * scale[:, None]).T + linear.bias
    out = q8(x.bfloat16())
    assert out.shape == (2, rows, 48) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, atol=0.03, rtol=0.02)
    assert (out.float() - linear(x)).abs().max() < 0.05  # and close to the fp32 layer


def test_int8_gemv_and_gemm_paths_agree():
    torch.manual_seed(0)
    q8 = Int8Linear(nn.Linear(96, 80, bias=False))
    x = torch.randn(16, 96).bfloat16()
    small = torch.cat([q8.matmul(x[i : i + 1]) for i in range(16)])  # rows < gemm_rows
    assert torch.allclose(small.float(), q8.matmul(x).float(), atol=0.03, rtol=0.02)


@pytest.fixture(scope="module")
def lm():
    config = ModelConfig.from_preset("llama-micro", vocab_size=97, max_seq_len=64)
    return LM.from_config(config, seed=0)


def test_conversion_copies_and_validates(lm):
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    q = to_inference_precision(lm.model, quantize="int8")
    assert q is not lm.model and isinstance(q.blocks[0].attn.qkv_proj, Int8Linear)
    assert q.embed.weight.dtype == resolve_dtype("auto", quantize="int8")  # chosen per machine
    assert all(torch.equal(before[k], v) for k, v in lm.model.state_dict().items())
    assert to_inference_precision(lm.model, dtype="float32") is lm.model  # nothing to do
    with pytest.raises(ConfigError, match="quantize"):
        to_inference_precision(lm.model, quantize="int3")
    with pytest.raises(ConfigError, match="dtype"):
        to_inference_precision(lm.model, dtype="float8")


def test_byte_counts(lm):
    n = lm.model.num_parameters()
    assert not lm.config.tie_embeddings  # a token reads one row of the table, not all of it
    assert weight_bytes(lm.model) == 4 * n and decode_bytes(lm.model) == 4 * (n - 97 * 128)
    tied = LM.from_config(ModelConfig.from_preset("gpt2-micro", vocab_size=97, max_seq_len=64))
    assert decode_bytes(tied.model) == 4 * (tied.model.num_parameters() - 64 * 128)  # positions
    q = to_inference_precision(lm.model, quantize="int8")
    layers = [m for m in q.modules() if isinstance(m, Int8Linear)]
    linears = sum(m.in_features * m.out_features for m in layers)
    assert decode_bytes(q) < weight_bytes(q) < 2 * n  # about 1 byte per linear weight
    assert decode_bytes(q) >= linears


@pytest.mark.parametrize(
    "precision, max_rel_error",
    [({"dtype": "bfloat16"}, 0.05), ({"quantize": "int8"}, 0.1)],
)
def test_reduced_precision_engine_agrees_with_fp32(lm, precision, max_rel_error):
    ids = torch.randint(0, 97, (4, 40), generator=torch.Generator().manual_seed(0))
    engine = Engine(lm.model, max_batch=4, eos_ids=[], **precision)
    act = "bfloat16" if "dtype" in precision else str(resolve_dtype("auto", quantize="int8"))[6:]
    assert engine.precision in ("bfloat16", f"int8 weights, {act} activations")
    with torch.inference_mode():
        ref, out = lm.model(ids), engine.model(ids).float()
    assert (out - ref).abs().max() / ref.std() < max_rel_error
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9  # teacher-forced greedy
    # decoding (one row at a time: the int8 GEMV kernel) matches the fp32 engine's first tokens
    params = GenerationParams(max_new_tokens=1, temperature=0.0)
    prompts = ids[:, :12].tolist()
    ours = [c.token_ids for c in engine.generate(prompts, params)]
    fp32 = [
        c.token_ids for c in Engine(lm.model, max_batch=4, eos_ids=[]).generate(prompts, params)
    ]
    assert sum(a == b for a, b in zip(ours, fp32)) >= 3


def test_fp16_kv_cache_where_a_quantised_model_decodes_compiled_in_fp32(lm):
    """The compiled CPU step of a quantised fp32 model keeps keys and values in fp16 (as
    llama.cpp's F16 cache); elsewhere the activations' dtype; an explicit kv_dtype wins. The
    policy is read without compiling anything (the step compiles on its first use)."""
    compiled = Engine(lm.model, max_batch=2, eos_ids=[], compile=True, quantize="int8",
                      dtype="float32")  # fmt: skip
    assert compiled.cache.k[0].dtype == torch.float16
    assert compiled.precision == "int8 weights, float32 activations, float16 KV cache"
    eager = Engine(lm.model, max_batch=2, eos_ids=[], quantize="int8", dtype="float32")
    assert eager.kv_dtype == torch.float32 and eager.precision.endswith("activations")
    assert Engine(lm.model, max_batch=2, eos_ids=[], compile=True).kv_dtype == torch.float32
    # an fp16 cache under eager decoding (the steps outside the compiled ranges run eagerly)
    # and prefill: the keys are upcast, the tokens follow the fp32-cache engine's
    half = Engine(lm.model, max_batch=4, eos_ids=[], quantize="int8", dtype="float32",
                  kv_dtype=torch.float16)  # fmt: skip
    params = GenerationParams(max_new_tokens=6, temperature=0.0)
    prompts = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(1)).tolist()
    ours = [c.token_ids for c in half.generate(prompts, params)]
    theirs = [c.token_ids for c in eager.generate(prompts, params)]
    assert sum(a == b for a, b in zip(ours, theirs)) >= 3


@pytest.mark.skipif(native_kernels() is None, reason="no native kernels")
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_swiglu_matches_the_gated_mlp_it_replaces(weights):
    """The engine's SwiGLU (one native silu(gate) * up pass; with bf16 weights past the GEMV
    rows, bf16 from gate and up's GEMM into down's) against GatedMLP's forward on the same
    layers, at a decode step's rows, the bf16 tile's and a prefill's."""
    torch.manual_seed(0)
    mlp = GatedMLP(64, 160, "silu", bias=False, dropout=0.0).eval()
    if weights == "bf16":  # as a BF16 GGUF file loads: 16-bit weights, fp32 activations
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, HalfLinear(getattr(mlp, name).weight.detach().bfloat16()))
    model = nn.ModuleDict({"norm": nn.LayerNorm(64), "mlp": mlp})  # a parameter as a model has
    fused = inference_model(model)["mlp"]
    assert isinstance(fused, SwiGLU) and type(mlp) is GatedMLP  # the caller's model is left alone
    assert fused.bf16_gemm == (weights == "bf16" and native_kernels().variant == "avx512_bf16")
    for rows in (1, 12, 100):
        x = torch.randn(2, rows, 64)
        with torch.inference_mode():
            y, expect = fused(x), GatedMLP.forward(fused, x)
        tol = 1e-5 if weights == "fp32" else 1e-2
        torch.testing.assert_close(y, expect, rtol=tol, atol=tol * expect.abs().max().item())


def test_lm_load_quantized(tmp_path, lm):
    lm.save(tmp_path)
    q = LM.load(tmp_path, quantize="int8")
    assert isinstance(q.model.lm_head, Int8Linear)
    prompts = [[1, 2, 3, 4]]
    out = q.generate(prompts, max_new_tokens=4, temperature=0.0, eos_ids=[])
    assert len(out[0]) == 4 and all(0 <= t < 97 for t in out[0])
    assert LM.load(tmp_path, dtype="bfloat16").model.embed.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("layout", ["q8_0", "int4", "bf16"])
def test_embedding_lookup_keeps_the_row_count_symbolic_under_export(layout):
    """A table lookup exported for 2 ids must hold for any number (the compiled decode step is
    exported once for a range of batch sizes): an output fixed at 2 rows made a step compiled
    at batch 2 return 2 rows' logits at batch 8."""
    from lmforge.infer.int4_linear import Int4Linear
    from lmforge.infer.quantized_linear import BlockInt8Linear, HalfLinear, QuantizedEmbedding

    linear = nn.Linear(64, 48, bias=False)
    table = {"q8_0": lambda: BlockInt8Linear(linear), "int4": lambda: Int4Linear(linear),
             "bf16": lambda: HalfLinear(linear.weight.detach().bfloat16())}[layout]()  # fmt: skip
    embed, ids = QuantizedEmbedding(table), torch.tensor([[3], [40]])
    ep = torch.export.export(embed, (ids,), dynamic_shapes=({0: torch.export.Dim.AUTO},),
                             strict=False)  # fmt: skip
    out = next(n for n in ep.graph.nodes if n.op == "output").args[0][0].meta["val"]
    assert isinstance(out.shape[0], torch.SymInt)
    many = torch.tensor([[5], [3], [47], [0], [40]])
    assert torch.equal(ep.module()(many), embed(many))
