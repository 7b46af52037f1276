"""Chunking: split a corpus into overlapping windows that a retriever can index and cite.

A corpus is read into `Document`s (a source id, a title and the text), then each document is cut
into `Chunk`s of `size` words (or characters) that start every `size - overlap` units. Overlap
keeps a sentence that straddles a boundary whole in at least one chunk. Every chunk keeps the id
and title of its document, so an answer built from it can say where it came from.

Sources: "builtin:pydoc" (one document per topic of the Python reference docs, titled by its
topic key), a text file, a folder (every file under it), or a .jsonl file with a "text" field
(and optional "id"/"title"). Binary or undecodable files in a folder are skipped, counted and
named in `Corpus.skipped`; a corpus with no text left is a DataError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.errors import ConfigError, DataError, require_choice
from lmforge.fileio import read_jsonl, read_text_file

SOURCES_HELP = "builtin:pydoc, a text file, a folder of text files, or a .jsonl file ('text')"


@dataclass(frozen=True)
class Document:
    source: str  # a stable id: "pydoc:assert", a relative file path, "file.jsonl:12"
    title: str
    text: str


@dataclass(frozen=True)
class Chunk:
    id: int  # position in the index
    source: str
    title: str
    text: str
    start: int  # offset of the window in its document, in chunking units (words or chars)


@dataclass
class Corpus:
    """Documents read from a source, plus the files that were skipped and why."""

    documents: list[Document]
    skipped: list[str] = field(default_factory=list)  # "path (reason)"

    def skip_message(self) -> str:
        if not self.skipped:
            return ""
        shown = ", ".join(self.skipped[:5]) + (" ..." if len(self.skipped) > 5 else "")
        return f"skipped {len(self.skipped)} file(s): {shown}"


# ---- reading ---------------------------------------------------------------------------------
def _first_line_title(text: str, fallback: str) -> str:
    lines = (line.strip().lstrip("#").strip() for line in text.splitlines())
    return next((line[:80] for line in lines if line), fallback)


def _read_pydoc() -> Corpus:
    from pydoc_data.topics import topics

    return Corpus([Document(f"pydoc:{k}", k, topics[k]) for k in sorted(topics)])


def _read_jsonl_texts(path: Path) -> Corpus:
    docs: list[Document] = []
    for lineno, row in read_jsonl(path):
        if not isinstance(row.get("text"), str):
            raise DataError(f"{path}:{lineno}: expected an object with a string 'text' field")
        source = str(row.get("id", f"{path.name}:{lineno}"))
        docs.append(Document(source, str(row.get("title", source)), row["text"]))
    return Corpus(docs)


def _read_document_folder(root: Path) -> Corpus:
    corpus = Corpus([])
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        name = str(path.relative_to(root))
        text, reason = read_text_file(path)
        if text is None:
            corpus.skipped.append(f"{name} ({reason})")
        else:
            corpus.documents.append(Document(name, _first_line_title(text, name), text))
    return corpus


def read_corpus(source: str | Path) -> Corpus:
    """Read `source` (see SOURCES_HELP) into documents; a missing source is a DataError."""
    text = str(source)
    if text == "builtin:pydoc":
        return _read_pydoc()
    if text.startswith("builtin:"):
        raise DataError(f"unknown builtin corpus {text!r}; the retrieval corpus is builtin:pydoc")
    path = Path(source)
    if not path.exists():
        raise DataError(f"corpus not found: {path} (expected {SOURCES_HELP})")
    if path.is_dir():
        return _read_document_folder(path)
    if path.name.endswith(".jsonl"):
        return _read_jsonl_texts(path)
    text, reason = read_text_file(path)
    if text is None:
        raise DataError(f"{path}: cannot index a {reason} file")
    return Corpus([Document(path.name, _first_line_title(text, path.name), text)])


# ---- splitting -------------------------------------------------------------------------------
# Each unit's spans: (start, end) character offsets of every word (the chunk text keeps the
# original spacing) or every character (for text without spaces, or exact size control).
SPLITTERS = {
    "word": lambda text: [m.span() for m in re.finditer(r"\S+", text)],
    "char": lambda text: [(i, i + 1) for i in range(len(text))],
}


def windows(text: str, size: int, overlap: int, unit: str = "word") -> list[tuple[int, str]]:
    """(start unit, text) of each window of `size` units stepping by size - overlap."""
    require_choice("chunk unit", unit, SPLITTERS)
    if size < 1 or not 0 <= overlap < size:
        raise ConfigError(f"need size >= 1 and 0 <= overlap < size, got {size=} {overlap=}")
    spans = SPLITTERS[unit](text)
    starts = range(0, max(1, len(spans) - overlap), size - overlap)
    pieces = ((start, spans[start : start + size]) for start in starts)
    return [(start, text[piece[0][0] : piece[-1][1]]) for start, piece in pieces if piece]


def chunk_documents(
    documents: list[Document], size: int = 200, overlap: int = 50, unit: str = "word"
) -> list[Chunk]:
    """Cut every document into overlapping windows; chunk ids number them in order."""
    chunks: list[Chunk] = []
    for doc in documents:
        for start, text in windows(doc.text, size, overlap, unit):
            if text.strip():
                chunks.append(Chunk(len(chunks), doc.source, doc.title, text, start))
    return chunks


def chunk_corpus(
    source: str | Path, size: int = 200, overlap: int = 50, unit: str = "word"
) -> tuple[list[Chunk], Corpus]:
    """Read and chunk `source`; DataError names the skipped files when no text remains."""
    corpus = read_corpus(source)
    chunks = chunk_documents(corpus.documents, size, overlap, unit)
    if not chunks:
        why = f" ({corpus.skip_message()})" if corpus.skipped else ""
        raise DataError(f"{source}: no text to index{why}")
    return chunks, corpus
