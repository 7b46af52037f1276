"""GGUF import, checked against transformers' own GGUF loader (the files: gguf_files.py), and
the real SmolLM2 file."""

import numpy as np
import pytest
import torch
from gguf_files import (
    TEMPLATE,
    TEXTS,
    Q,
    assert_as_stored,
    assert_same_model,
    batch_ids,
    gguf,
    hf_from_gguf,
    hf_tokenizer,
    random_k_blocks,
    write_gguf,
)

from lmforge.cli.main import main
from lmforge.interop.gguf import load_gguf
from lmforge.lm import LM


# ---- import ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "qtype",
    [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K],
    ids=lambda q: q.name,
)
def test_llama_quant_types_match_transformers(tmp_path, bpe_vocab, qtype, build_hf):
    vocab = bpe_vocab
    hf = build_hf("LlamaConfig", len(vocab["tokens"]), tie_word_embeddings=qtype == Q.Q4_K)
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", qtype, vocab)
    lm = LM.load(path, dtype="float32")
    ref = hf_from_gguf(path)
    assert_same_model(ref, lm, hf.config.vocab_size)
    assert_as_stored(path, ref, lm, hf.config.vocab_size)
    if qtype == Q.F32:  # unquantised: the source model itself is a second oracle
        x = batch_ids(hf.config.vocab_size)
        with torch.no_grad():
            assert (hf(x).logits - lm.model(x)).abs().max().item() <= 1e-4


@pytest.mark.parametrize(("kind", "v_kind", "bits"), [(Q.Q4_0, Q.Q4_1, 4), (Q.Q5_0, Q.Q4_1, 5),
                                                     (Q.Q5_0, Q.Q8_0, 8)])  # fmt: skip
def test_a_layer_joining_two_block_types_keeps_both_exactly(tmp_path, bpe_vocab, build_hf, kind,
                                                             v_kind, bits):  # fmt: skip
    """q and k in Q4_0 or Q5_0, v in Q4_1 or Q8_0 (one fused qkv layer; SmolLM2's Q4_K_M file
    joins Q5_0 and Q8_0): with Q4_1 the layer takes the asymmetric int4 / int5 layout with the
    symmetric parts' implied offsets, with Q8_0 Q8_0 blocks (Q5_0's centred codes fit int8); the
    other layers the symmetric layout; all hold the file's weights exactly (the dense load,
    through gguf-py's dequantisation, is the oracle)."""
    hf = build_hf("LlamaConfig", len(bpe_vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", kind, bpe_vocab,
                      qtypes={"attn_v": v_kind})  # fmt: skip
    dense, lm = LM.load(path, dtype="float32"), LM.load(path)
    for name, symmetric in [("blocks.0.attn.qkv_proj", False), ("blocks.0.attn.o_proj", True)]:
        layer = lm.model.get_submodule(name)
        assert layer.bits == (bits if name.endswith("qkv_proj") else min(bits, 5))
        assert getattr(layer, "symmetric", False) == symmetric
        weight = dense.model.get_submodule(name).weight
        assert torch.equal(layer.dequantize(dtype=torch.float32), weight)


def test_a_fused_layer_mixing_formats_keeps_each_part_as_stored(tmp_path, bpe_vocab, build_hf):
    """q and k in Q8_0, v in Q6_K (as llama-quantize's Q4_K_M mixes Q4_K and Q6_K in qkv): no
    one layout holds both, so the fused layer keeps each part in its own layer and equals the
    dense load (gguf-py's dequantisation) exactly, every row range; the logits agree with it."""
    from lmforge.infer.int4_linear import Int6Linear
    from lmforge.infer.quantized_linear import BlockInt8Linear

    hf = build_hf("LlamaConfig", len(bpe_vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.Q8_0, bpe_vocab,
                      qtypes={"attn_v": Q.Q6_K})  # fmt: skip
    dense, lm = LM.load(path, dtype="float32"), LM.load(path)
    layer = lm.model.get_submodule("blocks.0.attn.qkv_proj")
    assert [type(p) for p in layer.parts] == [BlockInt8Linear, BlockInt8Linear, Int6Linear]
    weight = dense.model.get_submodule("blocks.0.attn.qkv_proj").weight
    assert torch.equal(layer.dequantize(dtype=torch.float32), weight)
    assert torch.equal(layer.dequantize(200, 300, torch.float32), weight[200:300])
    x = batch_ids(hf.config.vocab_size)
    with torch.no_grad():
        a, b = dense.model(x), lm.model(x)
    assert (a - b).norm() / a.norm() < 0.03


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K], ids=lambda q: q.name)
def test_k_quant_blocks_become_int4_groups_up_to_fp16_products(tmp_path, qtype):
    """Oracle gguf-py's dequantisation: a Q4_K / Q5_K tensor's sub-blocks of 32 become int4 /
    int5 groups whose scale d sc and offset -dmin m are rounded to fp16. With power-of-two d
    and dmin those products are fp16 numbers and the layer holds gguf-py's weights bit for bit;
    with others the error is that rounding's (< 2^-11 of each product), as reported."""
    from gguf.quants import dequantize

    from lmforge.infer.int4_linear import Int4Linear
    from lmforge.interop.gguf_blocks import read_k_blocks
    from lmforge.interop.gguf_read import GGUFFile

    rng = np.random.default_rng(0)
    scales = {"exact": np.full((40, 2), 2.0**-12, dtype=np.float16),
              "rounded": (rng.random((40, 2)) * 1e-3 + 1e-4).astype(np.float16)}  # fmt: skip
    for case, scale in scales.items():
        writer = gguf.GGUFWriter(str(tmp_path / f"{case}.gguf"), "llama")
        writer.add_tensor("w", random_k_blocks((40, 512), qtype, scale=scale), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        f = GGUFFile(tmp_path / f"{case}.gguf")
        theirs = torch.from_numpy(np.array(dequantize(f.blocks("w"), qtype), dtype=np.float32))
        nibbles, d, m, high, (error, norm) = read_k_blocks(f, "w")
        assert (high is None) == (qtype == Q.Q4_K)
        layer = Int4Linear.from_q4_blocks(nibbles, d, m, dtype=torch.float32, high=high)
        ours = layer.dequantize()
        if case == "exact":
            assert error == 0 and torch.equal(ours, theirs.view(40, 512))
        else:
            relative = float((ours - theirs).norm() / theirs.norm())
            assert 0 < relative < 2**-11 and relative == pytest.approx((error / norm) ** 0.5,
                                                                         rel=1e-3)  # fmt: skip
        f.close()


@pytest.mark.parametrize(
    "arch,cls_name,kwargs",
    [
        ("qwen2", "Qwen2Config", {}),
        # transformers' GGUF loader keeps Qwen3Config's head_dim=128, so the file must match
        ("qwen3", "Qwen3Config", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128)),
        ("phi3", "Phi3Config", dict(num_key_value_heads=4, pad_token_id=0)),
        ("gpt2", "GPT2Config", {}),
    ],
)
def test_other_architectures_match_transformers(
    tmp_path, bpe_vocab, arch, cls_name, kwargs, build_hf
):
    hf = build_hf(cls_name, len(bpe_vocab["tokens"]), **kwargs)
    path = write_gguf(tmp_path / "m.gguf", hf, arch, Q.Q8_0, bpe_vocab)
    lm = LM.load(path, dtype="float32")
    ref = hf_from_gguf(path)
    assert_same_model(ref, lm, hf.config.vocab_size)
    assert_as_stored(path, ref, lm, hf.config.vocab_size)
    assert lm.config.extra["hf_model_type"] == arch


@pytest.mark.parametrize(
    "arch,cls_name,kwargs",
    [
        ("gemma", "GemmaConfig", dict(head_dim=64)),
        # transformers' GGUF loader keeps the config defaults GGUF has no key for (query scale
        # 256^-1/2, Gemma 2's soft caps 50 / 30, Gemma 3's local RoPE base and every 6th layer
        # full): the models use them, with head_dim 256 as the scale assumes
        ("gemma2", "Gemma2Config", dict(head_dim=256, sliding_window=6)),
        ("gemma3", "Gemma3TextConfig", dict(head_dim=256, sliding_window=6, num_hidden_layers=6)),
    ],
)
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_gemma_matches_transformers(tmp_path, bpe_vocab, arch, cls_name, kwargs, qtype, build_hf):
    if arch == "gemma" and qtype != Q.F32:
        pytest.skip("transformers reads no Gemma 1 GGUF: the source model is the only oracle")
    hf = build_hf(cls_name, len(bpe_vocab["tokens"]), **kwargs)
    path = write_gguf(tmp_path / "m.gguf", hf, arch, qtype, bpe_vocab)
    lm = LM.load(path, dtype="float32")
    ref = hf_from_gguf(path) if arch != "gemma" else hf
    assert type(ref).__name__ == type(hf).__name__
    assert_same_model(ref, lm, hf.config.vocab_size)
    if qtype == Q.F32:  # the source model itself is a second oracle (24 tokens > the window)
        x = batch_ids(hf.config.vocab_size)
        with torch.no_grad():
            assert (hf(x).logits - lm.model(x)).abs().max().item() <= 1e-4
    else:  # int8 activations' rounding grows with depth: on these random models 2 layers of
        # Gemma 2 give 3.1-3.7%, 6 of Gemma 3 6.0% (Llama: 2 layers 2.8%, 6 layers 4.9%)
        assert_as_stored(path, ref, lm, hf.config.vocab_size, tol=0.08)


@pytest.mark.parametrize("kind,arch", [("bpe", "llama"), ("spm", "llama"), ("spm", "phi3")])
def test_tokenizer_matches_transformers(tmp_path, bpe_vocab, spm_vocab, kind, arch, build_hf):
    vocab = bpe_vocab if kind == "bpe" else spm_vocab
    cls_name = "Phi3Config" if arch == "phi3" else "LlamaConfig"
    kwargs = {"pad_token_id": 0} if arch == "phi3" else {}
    hf = build_hf(cls_name, len(vocab["tokens"]), **kwargs)
    path = write_gguf(tmp_path / "m.gguf", hf, arch, Q.F16, vocab)
    tok = LM.load(path).tokenizer
    ref = hf_tokenizer(path)
    extra = [f"{ref.bos_token}x{ref.eos_token} y", "  two leading spaces", "a<|user|>b <unk>"]
    for text in TEXTS + extra:
        ids = tok.encode(text)
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        assert tok.decode(ids) == ref.decode(ids)
    assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id)
    # the file's add_bos flag reaches the saved tokenizer.json's post-processor
    assert tok.backend.encode("a").ids[0] == (
        tok.bos_id if vocab["add_bos"] else tok.encode("a")[0]
    )
    assert tok.chat_template == TEMPLATE


def test_generation_config_and_cli_checkpoint(tmp_path, bpe_vocab, capsys, build_hf):
    hf = build_hf("LlamaConfig", len(bpe_vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.Q8_0, bpe_vocab)
    model, tok, generation = load_gguf(path, dtype=torch.float32)
    assert generation["eos_token_id"] == bpe_vocab["eos"]
    assert main(["convert", "--from-gguf", str(path), "--out", str(tmp_path / "ours")]) == 0
    back = LM.load(tmp_path / "ours")
    x = batch_ids(hf.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(back.model(x), model(x))
    assert back.tokenizer.encode(TEXTS[0]) == tok.encode(TEXTS[0])
    capsys.readouterr()
    assert main(["model-info", "--checkpoint", str(path)]) == 0
    embedding = capsys.readouterr().out.splitlines()[1].split()
    assert embedding == ["embedding", f"{hf.config.vocab_size * 256:,}"]


def test_llama3_rope_freqs_tensor(tmp_path, bpe_vocab, build_hf):
    """Llama 3.x files carry their RoPE scaling as per-frequency divisors (rope_freqs);
    transformers' GGUF loader ignores them, so the oracle here is the source model."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}  # fmt: skip
    hf = build_hf("LlamaConfig", len(bpe_vocab["tokens"]), rope_parameters=rope)
    # llama.cpp's LlamaModel.generate_extra_tensors
    dim, base = 64, 500000.0
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wl, high_wl = 16 / 1.0, 16 / 4.0
    factors = []
    for f in freqs:
        wl = 2 * np.pi / f
        if wl < high_wl:
            factors.append(1.0)
        elif wl > low_wl:
            factors.append(8.0)
        else:
            smooth = (16 / wl - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / 8.0 + smooth))
    path = tmp_path / "m.gguf"
    write_gguf(path, hf, "llama", Q.F32, bpe_vocab)
    # rewrite with the extra tensor (GGUFWriter cannot append)
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "r.gguf"), arch="llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, value, vtype, sub_type=sub)
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    lm = LM.load(tmp_path / "r.gguf", dtype="float32")
    assert lm.config.rope_scaling["rope_type"] == "llama3"
    x = batch_ids(hf.config.vocab_size, seq=48)
    with torch.no_grad():
        assert (hf(x).logits - lm.model(x)).abs().max().item() <= 1e-4


# ---- the real SmolLM2 file ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_gguf_matches_transformers(smollm2_gguf):
    path = smollm2_gguf
    lm = LM.load(path, dtype="float32")
    ref = hf_from_gguf(path)
    x = batch_ids(lm.config.vocab_size, seq=32)
    prompt = x[:1, :10]
    ours = lm.generate(prompt.tolist(), max_new_tokens=16, temperature=0.0, eos_ids=[])
    theirs = ref.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert theirs[0, 10:].tolist() == ours[0]
    # Both in float32, the dtype transformers loads in. Positions up to 128: the RoPE tables
    # matter there (inverse frequencies rounded in float64 instead of float32 put the logits
    # 1.2e-4 apart). Not float64: transformers' RMSNorm computes in float32 whatever the dtype.
    long = batch_ids(lm.config.vocab_size, seq=128)
    with torch.no_grad():
        a, b = ref(long).logits, lm.model(long)
    assert a.abs().max() > 5
    assert (a - b).abs().max().item() <= 1e-4
    ref_tok = hf_tokenizer(path)
    tok = lm.tokenizer
    for text in TEXTS + ["<|im_start|>user\nBonjour 👋<|im_end|>\n"]:
        assert tok.encode(text) == ref_tok(text, add_special_tokens=False).input_ids, text
    messages = [{"role": "user", "content": "Wie spät ist es? 你好"}]
    from lmforge.interop.chat_template import render_chat

    assert render_chat(tok, messages, add_generation_prompt=True) == ref_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
