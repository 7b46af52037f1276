"""GGUF import/export, checked against transformers' own GGUF loader.

Tiny GGUF files are written here with the `gguf` package the way llama.cpp's convert_hf_to_gguf.py
writes them (tensor names from gguf's TensorNameMap, llama's q/k row permutation, GPT-2's
projections transposed), from random transformers models; the oracle for every comparison is
`AutoModelForCausalLM/AutoTokenizer.from_pretrained(folder, gguf_file=name)`.
"""

import json
import warnings

import numpy as np
import pytest
import torch

from lmforge.cli.main import main
from lmforge.errors import CheckpointError, ConfigError
from lmforge.infer.quantize import to_inference_precision
from lmforge.infer.quantized_linear import BlockInt8Linear, HalfLinear, Int4Linear
from lmforge.interop.gguf import export_gguf, load_gguf
from lmforge.interop.gguf_read import gguf_names, permute_qk
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it

Q = gguf.GGMLQuantizationType
TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces and\ttabs\nnew lines",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein.",
    "机器学习很有趣。",
    "emoji 🤗🚀 and numbers 1234567 3.14",
    "def f(x):\n    return x ** 2  # code",
]
CORPUS = [t * 3 for t in TEXTS] + ["the cat sat on the mat with another cat"] * 20
TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPM_SPECIALS = ["<unk>", "<s>", "</s>"]


# ---- writing GGUF files the llama.cpp way ------------------------------------------------------
def _bpe_vocab():
    """Byte-level BPE metadata (gpt2 model) from a tiny trained tokenizer."""
    tok = Tokenizer.train_bpe(CORPUS, vocab_size=400, min_frequency=1)
    data = json.loads(tok.backend.to_str())
    added = {a["id"] for a in data["added_tokens"]}
    tokens = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
    return {
        "model": "gpt2",
        "pre": "gpt-2",
        "tokens": tokens,
        # <|user|> as USER_DEFINED (matched whole, not special), the other specials CONTROL
        "token_type": [
            4 if tokens[i] == "<|user|>" else 3 if i in added else 1 for i in range(len(tokens))
        ],
        "merges": [" ".join(m) for m in data["model"]["merges"]],
        "bos": tok.bos_id,
        "eos": tok.eos_id,
        "pad": tok.pad_id,
        "unk": tok.unk_id,
        "add_bos": False,
    }


def _spm_vocab():
    """SentencePiece-style metadata (llama model): <unk>/<s>/</s>, 256 byte tokens, pieces with
    scores and no merges (transformers and we derive the merges from the scores)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    pieces = [backend.id_to_token(i) for i in range(backend.get_vocab_size())]
    tokens = SPM_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return {
        "model": "llama",
        "tokens": tokens,
        "token_type": types,
        "scores": [-float(i) for i in range(len(tokens))],
        "bos": 1,
        "eos": 2,
        "unk": 0,
        "add_bos": True,
    }


def _add_vocab(w, v):
    w.add_tokenizer_model(v["model"])
    if "pre" in v:
        w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["token_type"])
    if "merges" in v:
        w.add_token_merges(v["merges"])
    if "scores" in v:
        w.add_token_scores(v["scores"])
    for role in ("bos", "eos", "unk", "pad"):
        if v.get(role) is not None:
            getattr(w, f"add_{role}_token_id")(v[role])
    w.add_add_bos_token(v["add_bos"])
    w.add_chat_template(TEMPLATE)


# gguf-py dequantises K-quants but cannot quantise to them: such tensors get random blocks
# whose fp16 super-block scales (byte offsets below) are set small enough for sane weights.
K_QUANT_SCALES = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}


def _random_k_blocks(shape, qtype, seed=0):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed + shape[0])
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        scale = np.full(raw.shape[:2], 2e-4 if qtype == Q.Q4_K else 6e-5, dtype=np.float16)
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def write_gguf(path, hf_model, arch, qtype=Q.F32, vocab=None, meta_overrides=None, drop=()):
    """Write `hf_model` as llama.cpp's converter would (tensors in `qtype`, 1-D in F32)."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name("tiny test model")
    if arch == "gpt2":
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_rope_dimension_count(head_dim)
        if head_dim * cfg.num_attention_heads != cfg.hidden_size or arch.startswith("gemma"):
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope = rope.get("full_attention", rope)  # Gemma 3: the full layers' base is written
        theta = rope.get("rope_theta") or getattr(cfg, "rope_theta", 10000.0)
        w.add_rope_freq_base(float(theta))
        if arch in ("gemma2", "gemma3"):  # as llama.cpp's conversion/gemma.py writes them
            if getattr(cfg, "attn_logit_softcapping", None):
                w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            if cfg.final_logit_softcapping:
                w.add_final_logit_softcapping(cfg.final_logit_softcapping)
            w.add_sliding_window(cfg.sliding_window)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_vocab_size(cfg.vocab_size)
    for key, value in (meta_overrides or {}).items():
        w.add_uint32(key, value)
    if vocab is not None:
        _add_vocab(w, vocab)
    state = {
        k: t for k, t in hf_model.state_dict().items()
        if not k.endswith((".attn.bias", ".attn.masked_bias")) and "rotary" not in k
        and not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }  # fmt: skip
    for hf_name, name in gguf_names(arch, cfg.num_hidden_layers, state).items():
        if name in drop:
            continue
        t = state[hf_name].detach().float()
        if arch == "llama" and ".attn_q." in name:
            t = permute_qk(t, cfg.num_attention_heads)
        if arch == "llama" and ".attn_k." in name:
            t = permute_qk(t, cfg.num_key_value_heads)
        if arch == "gpt2" and t.dim() == 2 and name.startswith("blk."):
            t = t.t()  # Conv1D [in, out] -> [out, in]
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's norms as the 1 + weight they scale by
        data = t.contiguous().numpy()
        if data.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, data)
        elif qtype in K_QUANT_SCALES:
            w.add_tensor(name, _random_k_blocks(data.shape, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def build_hf(random_hf_model):
    """build_hf(cls_name, vocab_size, seed=0, **config): a random transformers model, wider
    than conftest's HF_CASES (a Q4/Q8 block is 32 columns), weights N(0, 0.08)."""

    def make(cls_name, vocab_size, seed=0, **kwargs):
        base = dict(
            vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        if cls_name == "GPT2Config":
            # transformers' GGUF loader ignores the context length (n_positions stays 1024)
            base = dict(vocab_size=vocab_size, n_embd=128, n_layer=2, n_head=4, n_positions=1024)
        return random_hf_model(cls_name, {**base, **kwargs}, seed, std=0.08)

    return make


def hf_from_gguf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def bpe_vocab():
    return _bpe_vocab()


@pytest.fixture(scope="module")
def spm_vocab():
    return _spm_vocab()


def _batch(vocab_size, seed=1, batch=2, seq=24):
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _assert_same_model(ref, lm, vocab_size, tol=1e-4):
    x = _batch(vocab_size)
    with torch.no_grad():
        a, b = ref(x).logits, lm.model(x)
    assert a.abs().max() > 0.5  # a real signal
    assert (a - b).abs().max().item() <= tol
    prompt = x[:1, :8]
    ours = lm.generate(prompt.tolist(), max_new_tokens=12, temperature=0.0, eos_ids=[])
    theirs = ref.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert theirs[0, 8:].tolist() == ours[0]


# the layer each stored type runs in by default (LM.load without a dtype), and whether that is
# the file's numbers exactly (else: re-quantised, with one warning saying so)
AS_STORED = {
    "F32": (torch.nn.Linear, True), "F16": (HalfLinear, True), "BF16": (HalfLinear, True),
    "Q8_0": (BlockInt8Linear, True), "Q4_0": (Int4Linear, True), "Q4_1": (Int4Linear, True),
    "Q4_K": (Int4Linear, False), "Q6_K": (BlockInt8Linear, False),
}  # fmt: skip


def _assert_as_stored(path, ref, dense, vocab_size, tol=0.03):
    """LM.load's default (the file's own precision) against transformers' float32 model: the
    layers are the kernels' formats, exact ones hold the file's numbers (the dense load's
    weights), and the logits agree up to the activations' rounding (int8 per block of 32 in the
    quantised kernels, 16-bit in the half GEMM)."""
    kind = gguf.GGUFReader(str(path)).tensors[1].tensor_type.name  # a block tensor of the file
    layer_type, exact = AS_STORED[kind]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = LM.load(path)
    converted = [w for w in caught if "re-quantised" in str(w.message)]
    assert len(converted) == (0 if exact else 1)
    name = "blocks.0.mlp.down_proj"
    layer = lm.model.get_submodule(name)
    assert type(layer) is layer_type
    weight = dense.model.get_submodule(name).weight
    if exact and layer_type is not torch.nn.Linear:
        assert torch.equal(layer.dequantize(dtype=torch.float32), weight)
    x = _batch(vocab_size)
    with torch.no_grad():
        a, b = ref(x).logits, lm.model(x)
    assert (a - b).norm() / a.norm() < tol
    prompt = x[:1, :8].tolist()
    ours = lm.generate(prompt, max_new_tokens=8, temperature=0.0, eos_ids=[])
    theirs = dense.generate(prompt, max_new_tokens=8, temperature=0.0, eos_ids=[])
    assert len(ours[0]) == 8 and ours[0][0] == theirs[0][0]  # later tokens: near-ties may flip
    if layer_type is not torch.nn.Linear:  # (an F32 file loads as a plain float32 model)
        with pytest.raises(ConfigError, match="own precision"):  # asked for after loading
            to_inference_precision(lm.model, "float32", "int8")


# ---- import ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name
)
def test_llama_quant_types_match_transformers(tmp_path, bpe_vocab, qtype, build_hf):
    vocab = bpe_vocab
    hf = build_hf("LlamaConfig", len(vocab["tokens"]), tie_word_embeddings=qtype == Q.Q4_K)
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", qtype, vocab)
    lm = LM.load(path, dtype="float32")
    ref = hf_from_gguf(path)
    _assert_same_model(ref, lm, hf.config.vocab_size)
    _assert_as_stored(path, ref, lm, hf.config.vocab_size)
    if qtype == Q.F32:  # unquantised: the source model itself is a second oracle
        x = _batch(hf.config.vocab_size)
        with torch.no_grad():
            assert (hf(x).logits - lm.model(x)).abs().max().item() <= 1e-4


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
    _assert_same_model(ref, lm, hf.config.vocab_size)
    _assert_as_stored(path, ref, lm, hf.config.vocab_size)
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
    _assert_same_model(ref, lm, hf.config.vocab_size)
    if qtype == Q.F32:  # the source model itself is a second oracle (24 tokens > the window)
        x = _batch(hf.config.vocab_size)
        with torch.no_grad():
            assert (hf(x).logits - lm.model(x)).abs().max().item() <= 1e-4
    else:  # int8 activations' rounding grows with depth: on these random models 2 layers of
        # Gemma 2 give 3.1-3.7%, 6 of Gemma 3 6.0% (Llama: 2 layers 2.8%, 6 layers 4.9%)
        _assert_as_stored(path, ref, lm, hf.config.vocab_size, tol=0.08)


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
    x = _batch(hf.config.vocab_size)
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
    x = _batch(hf.config.vocab_size, seq=48)
    with torch.no_grad():
        assert (hf(x).logits - lm.model(x)).abs().max().item() <= 1e-4


# ---- export ------------------------------------------------------------------------------------
def _our_llama(tok, **kw):
    kw = {"tie_embeddings": False, **kw}
    config = ModelConfig(vocab_size=tok.vocab_size + 3, n_layer=2, d_model=64, n_head=4,
                         n_kv_head=2, d_ff=128, max_seq_len=64, pos="rope", norm="rmsnorm",
                         mlp="swiglu", bias=False, **kw)  # fmt: skip
    lm = LM.from_config(config, tokenizer=tok, seed=0)
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    lm.model.eval()
    return lm


@pytest.mark.parametrize(
    "dtype,kw",
    [("f16", {}), ("bf16", {"tie_embeddings": True}), ("q8_0", {"rope_interleaved": True})],
)
def test_export_loads_in_transformers_and_back(tmp_path, dtype, kw):
    tok = Tokenizer.train_bpe(CORPUS, vocab_size=400, min_frequency=1)
    tok.chat_template = TEMPLATE
    lm = _our_llama(tok, **kw)
    path = export_gguf(lm, tmp_path / "out.gguf", dtype=dtype)
    ref = hf_from_gguf(path)
    back = LM.load(path, dtype="float32")
    x = _batch(lm.config.vocab_size)
    with torch.no_grad():
        theirs, ours, original = ref(x).logits, back.model(x), lm.model(x)
    assert (theirs - ours).abs().max().item() <= 1e-4  # same file, same numbers
    tol = {"f16": 2e-2, "bf16": 1e-1, "q8_0": 1e-1}[dtype]  # what the weight rounding costs
    assert (theirs - original).abs().max().item() <= tol * original.abs().max().item()
    ref_tok = hf_tokenizer(path)
    for text in TEXTS:
        assert ref_tok(text, add_special_tokens=False).input_ids == tok.encode(text)
        assert back.tokenizer.encode(text) == tok.encode(text)
    assert back.tokenizer.chat_template == TEMPLATE
    assert back.tokenizer.eos_id == tok.eos_id


def test_export_cli(tmp_path, capsys):
    tok = Tokenizer.train_bpe(CORPUS, vocab_size=400, min_frequency=1)
    _our_llama(tok).save(tmp_path / "ckpt")
    out = tmp_path / "m.gguf"
    args = ["convert", "--to-gguf", str(out), "--checkpoint", str(tmp_path / "ckpt")]
    assert main([*args, "--dtype", "q8_0"]) == 0
    assert "llama GGUF, q8_0" in capsys.readouterr().out
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.attn_q.weight"] == Q.Q8_0 and types["blk.0.attn_norm.weight"] == Q.F32


# ---- bad input ---------------------------------------------------------------------------------
def test_export_rejects_non_llama_without_writing(tmp_path):
    tok = Tokenizer.train_bpe(CORPUS, vocab_size=400, min_frequency=1)
    config = ModelConfig(vocab_size=tok.vocab_size, n_layer=1, d_model=32, n_head=2,
                         pos="learned", norm="layernorm", mlp="gelu")  # fmt: skip
    lm = LM.from_config(config, tokenizer=tok)
    with pytest.raises(ConfigError, match="cannot be written as a llama.cpp"):
        export_gguf(lm, tmp_path / "x.gguf")
    char = Tokenizer.train_char(CORPUS)
    with pytest.raises(ConfigError, match="cannot be written to GGUF"):
        export_gguf(_our_llama(char), tmp_path / "x.gguf")
    with pytest.raises(ConfigError, match="dtype"):
        export_gguf(_our_llama(tok), tmp_path / "x.gguf", dtype="q4_0")
    assert list(tmp_path.iterdir()) == []


def _one_line(err):
    message = str(err.value)
    assert "\n" not in message
    return message


def _unsupported_architecture(tmp_path, vocab, build_hf):
    hf = build_hf("LlamaConfig", len(vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.F32, vocab)
    data = path.read_bytes().replace(b"llama", b"mamba")  # architecture and its metadata keys
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    path.unlink()
    return bad


def test_unsupported_architecture(tmp_path, bpe_vocab, build_hf):
    with pytest.raises(CheckpointError) as err:
        LM.load(_unsupported_architecture(tmp_path, bpe_vocab, build_hf))
    message = _one_line(err)
    assert "'mamba' is not supported" in message and "llama, qwen2, qwen3, phi3, gpt2" in message


def _unsupported_tensor_type(tmp_path, vocab, build_hf):
    hf = build_hf("LlamaConfig", len(vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.F32, vocab)
    reader = gguf.GGUFReader(str(path))
    # Q8_1 is a ggml type gguf-py cannot dequantise: relabel one F32 tensor's type id in place
    # (its data shrinks to 36 bytes per 32 values, so the file stays long enough)
    field = next(t for t in reader.tensors if t.name == "blk.0.ffn_norm.weight").field
    type_offset = field.offset + sum(int(p.nbytes) for p in field.parts[:4])
    raw = bytearray(path.read_bytes())
    assert int.from_bytes(raw[type_offset : type_offset + 4], "little") == Q.F32
    raw[type_offset : type_offset + 4] = int(Q.Q8_1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    return path


def test_unsupported_tensor_type(tmp_path, bpe_vocab, build_hf):
    with pytest.raises(CheckpointError) as err:
        LM.load(_unsupported_tensor_type(tmp_path, bpe_vocab, build_hf))
    message = _one_line(err)
    assert "Q8_1 are not supported" in message and "Q4_K" in message and "Q8_0" in message


def test_truncated_file(tmp_path, bpe_vocab, build_hf):
    hf = build_hf("LlamaConfig", len(bpe_vocab["tokens"]))
    path = write_gguf(tmp_path / "m.gguf", hf, "llama", Q.Q8_0, bpe_vocab)
    data = path.read_bytes()
    for cut in (len(data) // 2, 40):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="truncated") as err:
            LM.load(tmp_path / "cut.gguf")
        _one_line(err)
    out = tmp_path / "out"
    assert main(["convert", "--from-gguf", str(tmp_path / "cut.gguf"), "--out", str(out)]) == 2
    assert not out.exists()
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        LM.load(tmp_path / "notes.txt")


def _shapes_contradicting_metadata(tmp_path, vocab, build_hf):
    hf = build_hf("LlamaConfig", len(vocab["tokens"]))
    return write_gguf(tmp_path / "a.gguf", hf, "llama", Q.F32, vocab,
                      meta_overrides={"llama.feed_forward_length": 384})  # fmt: skip


def test_shapes_contradicting_metadata(tmp_path, bpe_vocab, build_hf):
    hf = build_hf("LlamaConfig", len(bpe_vocab["tokens"]))
    with pytest.raises(CheckpointError, match=r"ffn_\w+\.weight has shape .* metadata implies"):
        LM.load(_shapes_contradicting_metadata(tmp_path, bpe_vocab, build_hf))
    path = write_gguf(tmp_path / "b.gguf", hf, "llama", Q.F32, bpe_vocab,
                      drop={"blk.1.attn_v.weight"})  # fmt: skip
    with pytest.raises(CheckpointError, match="missing tensor.*blk.1.attn_v.weight"):
        LM.load(path)


@pytest.mark.parametrize(
    "make, message",
    [
        (_unsupported_architecture, "'mamba' is not supported"),
        (_unsupported_tensor_type, "Q8_1 are not supported"),
        (_shapes_contradicting_metadata, "metadata implies"),
    ],
)
def test_bad_file_convert_says_one_line_and_writes_nothing(tmp_path, bpe_vocab, capsys, make,
                                                           message, build_hf):  # fmt: skip
    bad = make(tmp_path, bpe_vocab, build_hf)
    out = tmp_path / "out"
    assert main(["convert", "--from-gguf", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err  # besides the error, stderr holds the progress bar
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [bad.name]


# ---- the real SmolLM2 file ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_gguf_matches_transformers(smollm2_gguf):
    path = smollm2_gguf
    lm = LM.load(path, dtype="float32")
    ref = hf_from_gguf(path)
    x = _batch(lm.config.vocab_size, seq=32)
    prompt = x[:1, :10]
    ours = lm.generate(prompt.tolist(), max_new_tokens=16, temperature=0.0, eos_ids=[])
    theirs = ref.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert theirs[0, 10:].tolist() == ours[0]
    # Both in float32, the dtype transformers loads in. Positions up to 128: the RoPE tables
    # matter there (inverse frequencies rounded in float64 instead of float32 put the logits
    # 1.2e-4 apart). Not float64: transformers' RMSNorm computes in float32 whatever the dtype.
    long = _batch(lm.config.vocab_size, seq=128)
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
