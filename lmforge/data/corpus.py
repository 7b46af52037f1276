"""Text corpora: built-in ones, local files/folders (txt, md, jsonl, parquet) and HF datasets.

Every reader yields documents (strings) lazily and skips empty ones; a source that yields no
document at all is an error, since training on nothing is never what the user meant.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

from lmforge.errors import DataError
from lmforge.fileio import read_jsonl, read_text_file

TEXT_SUFFIXES = (".txt", ".md")
SOURCE_FORMS = (
    "builtin:pydoc, builtin:shakespeare, a .txt/.md file, a folder of .txt/.md files, "
    "a .jsonl/.jsonl.gz file, a .parquet file, or hf:NAME[:CONFIG]"
)


def shared_data_dir() -> Path:
    """The ../shared/data folder beside the checkout, or $LMFORGE_SHARED_DATA when set."""
    if env := os.environ.get("LMFORGE_SHARED_DATA"):
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def builtin_corpus(name: str = "pydoc") -> list[str]:
    """A corpus that needs no download.

    "pydoc" is the Python reference documentation shipped with every CPython (pydoc_data.topics,
    ~465 KB of English), one document per topic in sorted-key order so it is deterministic.
    "shakespeare" is Tiny Shakespeare from the shared data folder, as a single document.
    """
    if name == "pydoc":
        from pydoc_data.topics import topics

        return [topics[key] for key in sorted(topics)]
    if name == "shakespeare":
        path = shared_data_dir() / "tinyshakespeare.txt"
        if not path.is_file():
            raise DataError(
                f"builtin corpus 'shakespeare' needs {path} (set LMFORGE_SHARED_DATA to the folder "
                "holding tinyshakespeare.txt)"
            )
        return [path.read_text(encoding="utf-8")]
    raise DataError(f"unknown builtin corpus {name!r}; choose 'pydoc' or 'shakespeare'")


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for lineno, row in read_jsonl(path):
        if text_field not in row:
            raise DataError(f"{path}:{lineno}: missing field {text_field!r}")
        if not isinstance(text := row[text_field], str):
            raise DataError(
                f"{path}:{lineno}: field {text_field!r} must be a string, got {type(text).__name__}"
            )
        yield text


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from e
    columns = pf.schema_arrow.names
    if text_field not in columns:
        raise DataError(f"{path}: no column {text_field!r} (columns: {', '.join(columns)})")
    for batch in pf.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _read_folder(folder: Path) -> Iterator[str]:
    skipped = 0
    for path in sorted(p for p in folder.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()):
        text, _ = read_text_file(path)
        if text is None:  # not UTF-8, or valid UTF-8 but binary content
            skipped += 1
        else:
            yield text
    if skipped:
        warnings.warn(f"{folder}: skipped {skipped} undecodable or binary file(s)", stacklevel=2)


def _read_hf(spec: str, text_field: str) -> Iterator[str]:
    name, _, config = spec.partition(":")
    try:
        import datasets

        ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
    except Exception as e:
        raise DataError(f"hf:{spec}: could not load the train split ({e})") from e
    for i, row in enumerate(ds):
        if text_field not in row:
            raise DataError(f"hf:{spec} row {i}: missing field {text_field!r}")
        if row[text_field] is not None:
            yield row[text_field]


def _documents(source: str | Path, text_field: str) -> Iterator[str]:
    """Dispatch on the source form; raises DataError for unknown or missing sources (eagerly)."""
    text = str(source)
    if text.startswith("builtin:"):
        return iter(builtin_corpus(text.removeprefix("builtin:")))
    if text.startswith("hf:"):
        if not text.removeprefix("hf:").strip(":"):
            raise DataError(f"{text!r}: expected hf:NAME[:CONFIG]")
        return _read_hf(text.removeprefix("hf:"), text_field)
    path = Path(source)
    if not path.exists():
        raise DataError(f"data source not found: {path}")
    if path.is_dir():
        return _read_folder(path)
    if path.suffix in TEXT_SUFFIXES:
        try:
            return iter([path.read_text(encoding="utf-8")])
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from e
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return _read_jsonl(path, text_field)
    if path.suffix == ".parquet":
        return _read_parquet(path, text_field)
    raise DataError(f"{path}: unsupported data source; expected {SOURCE_FORMS}")


def read_documents(source: str | Path, text_field: str = "text") -> Iterator[str]:
    """Yield the non-empty documents of `source` (see SOURCE_FORMS; a Hugging Face dataset's
    train split), lazily.

    A missing or unsupported source raises DataError at once; a source that turns out to hold no
    non-empty document raises DataError when the iterator is exhausted.
    """
    docs = _documents(source, text_field)

    def generate() -> Iterator[str]:
        count = 0
        for doc in docs:
            if doc.strip():
                count += 1
                yield doc
        if count == 0:
            raise DataError(f"{source}: no non-empty documents")

    return generate()
