"""Retriever: sparse (BM25), dense (sentence embeddings) and hybrid (RRF) search over chunks.

BM25 finds exact terms ("nonlocal", "__slots__"); dense embeddings find paraphrases ("how do I
leave a loop early"). Reciprocal Rank Fusion merges the two rankings by rank alone, so their
different score scales never need calibrating. An index is a folder:

    index.json              format, counts, encoder name and dimension, chunking settings
    chunks.json             the chunks (id, source, title, text, start)
    embeddings.safetensors  [N, D] float32 unit vectors (absent for a BM25-only index)
    bm25/                   the bm25s arrays (.npy, no pickle) and their settings
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lmforge.errors import CheckpointError, ConfigError, require_choice, require_int
from lmforge.fileio import load_tensors, read_json, save_tensors, write_json
from lmforge.nlp.bm25 import BM25Index
from lmforge.nlp.fusion import reciprocal_rank_fusion
from lmforge.progress import progress_bar
from lmforge.retrieval.chunking import Chunk

INDEX_FORMAT = "lmforge.rag-index/1"
DEFAULT_ENCODER = "all-MiniLM-L6-v2"


@dataclass(frozen=True)
class Hit:
    chunk: Chunk
    score: float
    rank: int  # 1 = best


def _dense_ranks(r: Retriever, query: str, n: int) -> list[tuple[int, float]]:
    """Cosine similarity of unit embeddings (a dot product)."""
    if r.embeddings is None:
        raise ConfigError("this index has no embeddings: rebuild it with a dense encoder")
    top = torch.topk(r.embeddings @ r.encoder.encode([query])[0], min(n, len(r.embeddings)))
    return [(int(i), float(s)) for s, i in zip(top.values, top.indices)]


def _hybrid_ranks(r: Retriever, query: str, n: int) -> list[tuple[int, float]]:
    """Weighted RRF over the top `depth` of each ranking: RRF(d) = sum w / (rrf_k + rank), with
    w = `fusion_weights` (BM25, dense); equal weights are plain RRF."""
    depth = max(n, r.fusion_depth)
    runs = [r.bm25.search(query, depth), _dense_ranks(r, query, depth)]
    fused = reciprocal_rank_fusion(
        [[i for i, _ in run] for run in runs], k=r.rrf_k, weights=list(r.fusion_weights)
    )
    return fused[:n]


# mode -> (retriever, query, n) -> the n best (chunk index, score), best first
SEARCH_MODES = {
    "bm25": lambda r, query, n: r.bm25.search(query, n),
    "dense": _dense_ranks,
    "hybrid": _hybrid_ranks,
}


class Retriever:
    """Chunks with a BM25 index and (optionally) their embeddings; `search` returns Hits."""

    def __init__(
        self,
        chunks: list[Chunk],
        bm25: BM25Index,
        embeddings: torch.Tensor | None = None,
        encoder=None,
        encoder_name: str | None = None,
        settings: dict | None = None,
        rrf_k: float = 60.0,
        fusion_depth: int = 50,
        fusion_weights: tuple[float, float] = (1.0, 1.0),
    ):
        self.chunks, self.bm25, self.embeddings = chunks, bm25, embeddings
        self._encoder, self.encoder_name = encoder, encoder_name
        self.settings = dict(settings or {})
        self.rrf_k, self.fusion_depth = rrf_k, fusion_depth
        self.fusion_weights = tuple(float(w) for w in fusion_weights)
        if len(self.fusion_weights) != 2 or min(self.fusion_weights) < 0:
            raise ConfigError(
                f"fusion_weights={fusion_weights!r}: expected two weights >= 0 (BM25, dense)"
            )

    @classmethod
    def build(
        cls,
        chunks: list[Chunk],
        encoder: str | object | None = DEFAULT_ENCODER,
        encoder_name: str | None = None,
        batch_size: int = 32,
        settings: dict | None = None,
        progress: bool = False,
    ) -> Retriever:
        """Index `chunks` with BM25 and, unless encoder is None, with dense embeddings.

        `encoder` is a SentenceEncoder, or a name/folder for SentenceEncoder.load.
        """
        if not chunks:
            raise ConfigError("Retriever.build: no chunks to index")
        texts = [c.text for c in chunks]
        bm25 = BM25Index().index(texts)
        if encoder is None:
            return cls(chunks, bm25, settings=settings)
        if isinstance(encoder, str | Path):
            from lmforge.retrieval.encoder import SentenceEncoder

            encoder_name, encoder = str(encoder), SentenceEncoder.load(str(encoder))
        parts = []
        with warnings.catch_warnings(record=True) as caught:  # one summary instead of a warning
            warnings.simplefilter("always")  # per batch that speaks of "queries"
            starts = range(0, len(texts), batch_size)
            for s in progress_bar(starts, desc="embedding", disable=not progress):
                parts.append(encoder.encode(texts[s : s + batch_size], batch_size=batch_size))
        if any("truncated" in str(w.message) for w in caught):
            limit = getattr(encoder, "max_seq_length", "its")
            warnings.warn(
                f"some chunks are longer than the encoder's {limit}-token limit: their dense "
                "embedding covers only the start (BM25 still sees every word); use smaller chunks",
                stacklevel=2,
            )
        if hasattr(encoder, "_warned_truncation"):  # the encoder warns once: keep that for queries
            encoder._warned_truncation = False
        name = encoder_name or getattr(encoder, "name", None) or "custom"
        return cls(chunks, bm25, torch.cat(parts), encoder, name, settings)

    @property
    def encoder(self):
        """The query encoder, loaded by its saved name the first time dense search needs it."""
        if self._encoder is None:
            if self.encoder_name is None:
                raise ConfigError("this index has no dense encoder: use mode='bm25'")
            from lmforge.retrieval.encoder import SentenceEncoder

            self._encoder = SentenceEncoder.load(self.encoder_name)
            self._check_dim(self._encoder, Path("."))
        return self._encoder

    @property
    def modes(self) -> list[str]:
        """Search modes this index supports."""
        return list(SEARCH_MODES) if self.embeddings is not None else ["bm25"]

    def __len__(self) -> int:
        return len(self.chunks)

    def search(self, query: str, k: int = 5, mode: str = "hybrid") -> list[Hit]:
        """The k best chunks for `query`, best first."""
        require_choice("search mode", mode, SEARCH_MODES)
        require_int("k", k)
        if not query.strip():
            raise ConfigError("empty query")
        ranked = SEARCH_MODES[mode](self, query, k)
        return [Hit(self.chunks[i], s, n) for n, (i, s) in enumerate(ranked, 1)]

    # ---- persistence -----------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write the index folder (see the module docstring)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.bm25.save(path / "bm25")
        index = {"format": INDEX_FORMAT, "n_chunks": len(self.chunks), "encoder": None, "dim": None}
        if self.embeddings is not None:
            index.update(encoder=self.encoder_name, dim=int(self.embeddings.shape[1]))
            meta = {"encoder": self.encoder_name or "", "dim": str(index["dim"])}
            save_tensors(path / "embeddings.safetensors", {"embeddings": self.embeddings}, meta)
        write_json(path / "chunks.json", [asdict(c) for c in self.chunks])
        fusion = {"rrf_k": self.rrf_k, "depth": self.fusion_depth, "weights": self.fusion_weights}
        index |= {"settings": self.settings, "fusion": fusion}
        write_json(path / "index.json", index)  # last: a folder without it is not (yet) an index

    @classmethod
    def load(
        cls, directory: str | Path, encoder=None, encoder_name: str | None = None
    ) -> Retriever:
        """Read an index folder; a missing or inconsistent one raises CheckpointError.

        `encoder` (optional) is the SentenceEncoder to embed queries with; it must produce
        vectors of the indexed dimension. `encoder_name`, when given, must be the name the index
        was built with. By default the saved encoder is loaded lazily, on the first dense query.
        """
        path = Path(directory)
        if not (path / "index.json").is_file():
            raise CheckpointError(
                f"no retrieval index at {path} (index.json missing): "
                "build one with `lmforge rag index --out DIR`"
            )
        meta = read_json(path / "index.json", "index metadata")
        if not isinstance(meta, dict) or meta.get("format") != INDEX_FORMAT:
            raise CheckpointError(f"{path / 'index.json'}: not a {INDEX_FORMAT} index")
        n = meta["n_chunks"]
        rows = read_json(path / "chunks.json", "chunk list")
        if not isinstance(rows, list) or len(rows) != n:
            got = len(rows) if isinstance(rows, list) else "no list"
            raise CheckpointError(f"{path / 'chunks.json'}: {got} chunks, index.json says {n}")
        try:
            chunks = [Chunk(**row) for row in rows]
        except TypeError as e:
            raise CheckpointError(f"{path / 'chunks.json'}: malformed chunk ({e})") from e
        saved = meta.get("encoder")
        if encoder_name is not None and saved is not None and encoder_name != saved:
            raise CheckpointError(
                f"{path}: index built with encoder {saved!r}, not {encoder_name!r}; "
                "rebuild it or drop the encoder option"
            )
        bm25 = BM25Index.load(path / "bm25")
        if len(bm25) != n:
            raise CheckpointError(f"{path / 'bm25'}: {len(bm25)} documents, index.json says {n}")
        embeddings = None
        if saved is not None:
            embeddings = load_tensors(path / "embeddings.safetensors").get("embeddings")
            shape = None if embeddings is None else tuple(embeddings.shape)
            if shape != (n, meta["dim"]):
                raise CheckpointError(
                    f"{path / 'embeddings.safetensors'}: embeddings of shape {shape}, "
                    f"index.json says ({n}, {meta['dim']})"
                )
        try:
            fusion = meta["fusion"]
            rrf = (float(fusion["rrf_k"]), int(fusion["depth"]), tuple(fusion["weights"]))
            r = cls(chunks, bm25, embeddings, None, meta.get("encoder"), meta.get("settings"), *rrf)
        except (TypeError, ValueError, KeyError, ConfigError) as e:
            raise CheckpointError(f"{path / 'index.json'}: bad 'fusion' settings ({e})") from None
        if encoder is not None:
            r._check_dim(encoder, path)
            r._encoder = encoder
        return r

    def _check_dim(self, encoder, path: Path) -> None:
        if self.embeddings is not None and encoder.dim != self.embeddings.shape[1]:
            raise CheckpointError(
                f"{path}: index built with encoder {self.encoder_name!r} "
                f"(dim {self.embeddings.shape[1]}) but the query encoder has dim {encoder.dim}; "
                "rebuild the index with this encoder"
            )
