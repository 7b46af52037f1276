"""Tiny GGUF files for the GGUF tests, written with the `gguf` package the way llama.cpp's
convert_hf_to_gguf.py writes them (tensor names from gguf's TensorNameMap, llama's q/k row
permutation, GPT-2's projections transposed), from random transformers models; the oracle for every
comparison is `AutoModelForCausalLM/AutoTokenizer.from_pretrained(folder, gguf_file=name)`.
"""

import json
import warnings

import numpy as np
import pytest
import torch

from lmforge.errors import ConfigError
from lmforge.infer.int4_linear import Int4Linear, Int6Linear
from lmforge.infer.quantize import to_inference_precision
from lmforge.infer.quantized_linear import BlockInt8Linear, HalfLinear
from lmforge.interop.gguf_read import gguf_names, permute_qk
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.model.linear import Linear
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
def make_bpe_vocab():
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


def make_spm_vocab():
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


def add_vocab(w, v):
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
K_QUANT_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_k_blocks(shape, qtype, seed=0, scale=None):
    """Random blocks with the fp16 scales `scale` [rows, blocks] (default: one small value)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed + shape[0])
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    if scale is None:
        scale = np.full(raw.shape[:2], 6e-5 if qtype == Q.Q6_K else 2e-4, dtype=np.float16)
    for offset in K_QUANT_SCALES[qtype]:
        raw[:, :, offset : offset + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def write_gguf(path, hf_model, arch, qtype=Q.F32, vocab=None, meta_overrides=None, drop=(),
               qtypes=None):  # fmt: skip
    """Write `hf_model` as llama.cpp's converter would (tensors in `qtype`, 1-D in F32;
    `qtypes`: {a part of a GGUF tensor name: its type instead}, as llama-quantize's mixes)."""
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
        add_vocab(w, vocab)
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
        kind = next((q for part, q in (qtypes or {}).items() if part in name), qtype)
        if data.ndim == 1 or kind == Q.F32:
            w.add_tensor(name, data)
        elif kind in K_QUANT_SCALES:
            w.add_tensor(name, random_k_blocks(data.shape, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_from_gguf(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def batch_ids(vocab_size, seed=1, batch=2, seq=24):
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def assert_same_model(ref, lm, vocab_size, tol=1e-4):
    x = batch_ids(vocab_size)
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
    "F32": (Linear, True), "F16": (HalfLinear, True), "BF16": (HalfLinear, True),
    "Q8_0": (BlockInt8Linear, True), "Q4_0": (Int4Linear, True), "Q4_1": (Int4Linear, True),
    "Q5_0": (Int4Linear, True), "Q5_1": (Int4Linear, True),
    "Q4_K": (Int4Linear, False), "Q5_K": (Int4Linear, False), "Q6_K": (Int6Linear, True),
}  # fmt: skip


def assert_as_stored(path, ref, dense, vocab_size, tol=0.03):
    """LM.load's default (the file's own precision) against transformers' float32 model: the
    layers are the kernels' formats, exact ones hold the file's numbers (the dense load's
    weights), and the logits agree up to the activations' rounding (int8 per block of 32 in the
    quantised kernels, 16-bit in the half GEMM)."""
    kind = gguf.GGUFReader(str(path)).tensors[1].tensor_type.name  # a block tensor of the file
    layer_type, exact = AS_STORED[kind]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lm = LM.load(path)
    converted = [w for w in caught if "converted per tensor" in str(w.message)]
    assert len(converted) == (0 if exact else 1)
    name = "blocks.0.mlp.down_proj"
    layer = lm.model.get_submodule(name)
    assert type(layer) is layer_type
    if layer_type is Int4Linear:  # Q4_0 / Q5_0 in the symmetric layouts (no offsets stored)
        assert layer.symmetric == kind.endswith("_0") and layer.bits == int(kind[1])
    weight = dense.model.get_submodule(name).weight
    if exact and layer_type is not Linear:
        assert torch.equal(layer.dequantize(dtype=torch.float32), weight)
    x = batch_ids(vocab_size)
    with torch.no_grad():
        a, b = ref(x).logits, lm.model(x)
    assert (a - b).norm() / a.norm() < tol
    prompt = x[:1, :8].tolist()
    ours = lm.generate(prompt, max_new_tokens=8, temperature=0.0, eos_ids=[])
    theirs = dense.generate(prompt, max_new_tokens=8, temperature=0.0, eos_ids=[])
    assert len(ours[0]) == 8 and ours[0][0] == theirs[0][0]  # later tokens: near-ties may flip
    if layer_type is not Linear:  # (an F32 file loads as a plain float32 model)
        with pytest.raises(ConfigError, match="own precision"):  # asked for after loading
            to_inference_precision(lm.model, "float32", "int8")


def our_llama(tok, **kw):
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
