"""A BERT-family encoder written by hand: bidirectional post-norm transformer, MLM/NSP/classifier
heads, the MLM and NSP data recipes, and a loader for Hugging Face BERT checkpoints."""

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lmforge.errors import CheckpointError, ConfigError, LMForgeError
from lmforge.model.io import read_config_json, read_tensors, weight_files
from lmforge.model.mlp import ACTIVATIONS, MLP
from lmforge.model.norms import LayerNorm

# Hugging Face spells the tanh approximation of GELU several ways; all compute the same function.
_HF_ACTIVATIONS = {"gelu": "gelu", "relu": "relu"} | dict.fromkeys(
    ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"), "gelu_tanh"
)
# Our field -> (HF config.json key, default; None = required).
_HF_FIELDS = {
    "vocab_size": ("vocab_size", None),
    "d_model": ("hidden_size", None),
    "n_layer": ("num_hidden_layers", None),
    "n_head": ("num_attention_heads", None),
    "d_ff": ("intermediate_size", None),
    "max_position": ("max_position_embeddings", 512),
    "type_vocab_size": ("type_vocab_size", 2),
    "layer_norm_eps": ("layer_norm_eps", 1e-12),
    "dropout": ("hidden_dropout_prob", 0.1),
    "attn_dropout": ("attention_probs_dropout_prob", 0.1),
}


@dataclass
class BertConfig:
    """Shape and regularisation of a BERT encoder; `from_hf_dict` reads HF's `config.json`."""

    vocab_size: int = 30522
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12
    d_ff: int = 3072
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"  # "gelu" (erf), "gelu_tanh" or "relu"
    dropout: float = 0.1
    attn_dropout: float = 0.1
    pad_token_id: int = 0
    num_labels: int = 2
    use_pooler: bool = True

    def __post_init__(self):
        if self.hidden_act not in _HF_ACTIVATIONS.values():
            raise ConfigError(f"hidden_act={self.hidden_act!r}: expected gelu, gelu_tanh or relu")
        if self.d_model % self.n_head:
            raise ConfigError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config.json") -> "BertConfig":
        """Build from a HF BERT `config.json` dict; absent optional fields get BERT's defaults."""
        if (model_type := d.get("model_type", "bert")) != "bert":
            raise ConfigError(f"{source}: model_type={model_type!r} is not supported (only 'bert')")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"{source}: position_embedding_type must be 'absolute'")
        if (act := d.get("hidden_act", "gelu")) not in _HF_ACTIVATIONS:
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported")
        kw = {}
        for ours, (key, default) in _HF_FIELDS.items():
            if d.get(key, default) is None:
                raise ConfigError(f"{source}: missing field {key!r}")
            kw[ours] = type(getattr(cls, ours))(d.get(key, default))
        labels = d.get("num_labels") or len(d.get("id2label") or {}) or 2
        pad = d.get("pad_token_id") or 0
        return cls(**kw, hidden_act=_HF_ACTIVATIONS[act], pad_token_id=pad, num_labels=labels)

    def to_hf_dict(
        self, architecture: str = "BertModel", label_names: list[str] | None = None
    ) -> dict:
        """The HF `config.json` dict for this config (the inverse of `from_hf_dict`)."""
        act = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[self.hidden_act]
        d = {"model_type": "bert", "architectures": [architecture]}
        d |= {key: getattr(self, ours) for ours, (key, _) in _HF_FIELDS.items()}
        names = label_names or [f"LABEL_{i}" for i in range(self.num_labels)]
        labels = {str(i): name for i, name in enumerate(names)}
        return d | {"hidden_act": act, "pad_token_id": self.pad_token_id, "id2label": labels,
                    "label2id": {v: int(k) for k, v in labels.items()},
                    "position_embedding_type": "absolute", "initializer_range": 0.02,
                    "tie_word_embeddings": True}  # fmt: skip


class BertEmbeddings(nn.Module):
    """Token + segment + learned absolute position embeddings, then LayerNorm and dropout."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position, cfg.d_model)
        self.segment = nn.Embedding(cfg.type_vocab_size, cfg.d_model)
        self.ln = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None):
        T = input_ids.shape[1]
        if T > self.position.num_embeddings:
            raise LMForgeError(f"{T} tokens exceed max_position={self.position.num_embeddings}")
        x = self.word(input_ids) + self.position.weight[:T]
        # Single-segment input (the common case) is segment 0 everywhere: add that row, no gather.
        x = x + (self.segment.weight[0] if token_type_ids is None else self.segment(token_type_ids))
        return self.drop(self.ln(x))


class BertSelfAttention(nn.Module):
    """Bidirectional multi-head attention; a boolean mask (True = attend) hides padded keys."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_head, self.attn_dropout = cfg.n_head, cfg.attn_dropout
        self.query = nn.Linear(cfg.d_model, cfg.d_model)
        self.key = nn.Linear(cfg.d_model, cfg.d_model)
        self.value = nn.Linear(cfg.d_model, cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            p(x).view(B, T, self.n_head, -1).transpose(1, 2)
            for p in (self.query, self.key, self.value)
        )
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class BertLayer(nn.Module):
    """Post-norm block: h = LN(h + Attn(h)); h = LN(h + FFN(h))."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = BertSelfAttention(cfg)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, cfg.hidden_act, bias=True, dropout=cfg.dropout)
        self.ln_attn = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.ln_ffn = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = self.ln_attn(h + self.drop(self.attn(h, mask)))
        return self.ln_ffn(h + self.mlp(h))


class BertModel(nn.Module):
    """The encoder: embeddings, n_layer BertLayers, and the [CLS] pooler.

    forward returns (last hidden states [B,T,d], pooled [B,d]); pooled is tanh(W h_[CLS] + b), or
    the raw [CLS] state when the checkpoint has no pooler weights (`use_pooler=False`).
    """

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.n_layer))
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.use_pooler else None
        self.apply(_init_weights)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        mask = None  # an all-ones mask changes nothing: without it SDPA takes its fastest path
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.bool()[:, None, None, :]  # [B,1,1,T]: same for heads and queries
        h = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            h = layer(h, mask)
        return h, (h[:, 0] if self.pooler is None else torch.tanh(self.pooler(h[:, 0])))


def _init_weights(m: nn.Module) -> None:
    # BERT's recipe: N(0, 0.02) for matrices and embeddings, zero biases, unit LayerNorm.
    if isinstance(m, nn.Linear | nn.Embedding):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class BertMLMHead(nn.Module):
    """dense + act + LN, then a decoder tied to the word embeddings plus its own output bias."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense, self.act = nn.Linear(cfg.d_model, cfg.d_model), ACTIVATIONS[cfg.hidden_act]
        self.ln = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, h: torch.Tensor, word_emb: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.act(self.dense(h)))
        return F.linear(h, word_emb, self.bias)


class BertForMaskedLM(nn.Module):
    """MLM: forward returns (logits [B,T,V], loss or None); labels are -100 where not predicted."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.bert, self.mlm = BertModel(cfg), BertMLMHead(cfg)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        h, _ = self.bert(input_ids, attention_mask, token_type_ids)
        logits = self.mlm(h, self.bert.embeddings.word.weight)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return logits, loss


class BertForPreTraining(nn.Module):
    """MLM + NSP: returns (mlm_logits, nsp_logits [B,2], summed loss or None); NSP 0 = is next."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.bert, self.mlm, self.nsp = BertModel(cfg), BertMLMHead(cfg), nn.Linear(cfg.d_model, 2)

    def forward(
        self, input_ids, attention_mask=None, token_type_ids=None, labels=None, nsp_labels=None
    ):
        h, pooled = self.bert(input_ids, attention_mask, token_type_ids)
        mlm_logits, nsp_logits = self.mlm(h, self.bert.embeddings.word.weight), self.nsp(pooled)
        loss = None
        if labels is not None and nsp_labels is not None:
            loss = F.cross_entropy(mlm_logits.flatten(0, 1), labels.flatten())
            loss = loss + F.cross_entropy(nsp_logits, nsp_labels)
        return mlm_logits, nsp_logits, loss


class BertForSequenceClassification(nn.Module):
    """Classifier on the pooled [CLS] vector: returns (logits [B,num_labels], loss or None)."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.bert, self.drop = BertModel(cfg), nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.d_model, cfg.num_labels)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        _, pooled = self.bert(input_ids, attention_mask, token_type_ids)
        logits = self.classifier(self.drop(pooled))
        return logits, (None if labels is None else F.cross_entropy(logits, labels))


def mask_tokens(
    input_ids: torch.Tensor,
    special_mask: torch.Tensor,
    vocab_size: int,
    mask_id: int,
    prob: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's MLM corruption. Returns new (inputs, labels); `input_ids` is left untouched.

    Each non-special token is selected with probability `prob`; a selected token becomes [MASK] 80%
    of the time, a uniformly random token 10%, and stays itself 10%. Labels are -100 elsewhere.
    """
    if special_mask.shape != input_ids.shape:
        shapes = f"{tuple(special_mask.shape)} vs input_ids {tuple(input_ids.shape)}"
        raise LMForgeError(f"mask_tokens: special_mask shape {shapes}")
    g, shape = generator, input_ids.shape
    selected = (torch.rand(shape, generator=g) < prob) & ~special_mask.bool()
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    r = torch.rand(shape, generator=g)
    random_tokens = torch.randint(vocab_size, shape, generator=g, dtype=input_ids.dtype)
    inputs = torch.where(selected & (r < 0.8), torch.full_like(input_ids, mask_id), input_ids)
    inputs = torch.where(selected & (r >= 0.8) & (r < 0.9), random_tokens, inputs)
    return inputs, labels


def make_nsp_pairs(
    docs: list[list[list[int]]],
    cls_id: int,
    sep_id: int,
    pad_id: int = 0,
    max_len: int = 512,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Next-sentence-prediction pairs from documents given as lists of tokenised sentences.

    For each adjacent sentence pair (A, B) keep B with probability 1/2 (label 0, as in HF), else
    swap in a random sentence from another document (label 1). Each row is [CLS] A [SEP] B [SEP],
    truncated longest-first to `max_len`, padded; returns input_ids, token_type_ids, attention_mask,
    next_sentence_label.
    """
    pool = [(d, i) for d, doc in enumerate(docs) for i in range(len(doc))]
    if len(docs) < 2 or not any(len(doc) >= 2 for doc in docs):
        raise LMForgeError("make_nsp_pairs needs two documents, one with two or more sentences")

    def rand(n: int) -> int:
        return int(torch.randint(n, (1,), generator=generator))

    rows, segments, labels = [], [], []
    for d, doc in enumerate(docs):
        for i in range(len(doc) - 1):
            a, b, label = list(doc[i]), list(doc[i + 1]), 0
            if rand(2):
                # BERT draws the random B from a different document.
                while (j := pool[rand(len(pool))])[0] == d:
                    pass
                b, label = list(docs[j[0]][j[1]]), 1
            while len(a) + len(b) > max_len - 3:
                (a if len(a) >= len(b) else b).pop()
            rows.append([cls_id, *a, sep_id, *b, sep_id])
            segments.append([0] * (len(a) + 2) + [1] * (len(b) + 1))
            labels.append(label)
    T = max(map(len, rows))
    return {
        "input_ids": torch.tensor([r + [pad_id] * (T - len(r)) for r in rows]),
        "token_type_ids": torch.tensor([s + [0] * (T - len(s)) for s in segments]),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows]),
        "next_sentence_label": torch.tensor(labels),
    }


# Our module names -> Hugging Face's, per encoder layer and for everything else.
_HF_LAYER = {
    "attn.query": "attention.self.query",
    "attn.key": "attention.self.key",
    "attn.value": "attention.self.value",
    "attn.out": "attention.output.dense",
    "ln_attn": "attention.output.LayerNorm",
    "mlp.up_proj": "intermediate.dense",
    "mlp.down_proj": "output.dense",
    "ln_ffn": "output.LayerNorm",
}
_HF_OTHER = {
    "embeddings.word": "embeddings.word_embeddings",
    "embeddings.position": "embeddings.position_embeddings",
    "embeddings.segment": "embeddings.token_type_embeddings",
    "embeddings.ln": "embeddings.LayerNorm",
    "pooler": "pooler.dense",
    "mlm.dense": "cls.predictions.transform.dense",
    "mlm.ln": "cls.predictions.transform.LayerNorm",
    "mlm": "cls.predictions",
    "nsp": "cls.seq_relationship",
    "classifier": "classifier",
}


def hf_name(name: str) -> str:
    """Hugging Face's name (without the `bert.` prefix) for one of our parameter names."""
    module, param = name.removeprefix("bert.").rsplit(".", 1)
    if m := re.fullmatch(r"layers\.(\d+)\.(.+)", module):
        return f"encoder.layer.{m[1]}.{_HF_LAYER[m[2]]}.{param}"
    return f"{_HF_OTHER[module]}.{param}"


def _hf_key(key: str) -> str:
    # TF-era checkpoints name LayerNorm parameters gamma/beta; newer ones tie decoder.bias to bias.
    for old, new in (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias")):
        key = key.replace(old, new)
    return key.removeprefix("bert.").replace("predictions.decoder.bias", "predictions.bias")


def load_bert(
    directory: str | Path,
    model_cls: type[nn.Module] = BertModel,
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, BertConfig]:
    """Load a Hugging Face BERT checkpoint folder (config.json + weights) into `model_cls`.

    Returns (model in eval mode, BertConfig). Tensors the model does not use (e.g. an MLM head when
    loading the bare encoder) are ignored; a missing or mis-shaped tensor raises CheckpointError.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found")
    cfg = BertConfig.from_hf_dict(read_config_json(config_path), source=str(config_path))
    files = weight_files(directory)
    weights = {_hf_key(k): v for k, v in read_tensors(files, list(files)).items()}
    # HF saves BertModel and BertForMaskedLM without a pooler when it was not trained; the NSP and
    # classifier heads read it, so for them a missing pooler is reported as a missing tensor.
    headless = model_cls in (BertModel, BertForMaskedLM)
    cfg.use_pooler = "pooler.dense.weight" in weights or not headless
    with torch.device("meta"):  # shapes only: every tensor comes from the checkpoint below
        model = model_cls(cfg)
    expected = model.state_dict()
    if missing := [hf_name(name) for name in expected if hf_name(name) not in weights]:
        raise CheckpointError(f"{directory}: missing tensors {', '.join(missing)}")
    state = {name: weights[hf_name(name)].to(dtype) for name in expected}
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{directory}: tensor {hf_name(name)!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[name].shape)} from {config_path.name}"
            )
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval(), cfg
