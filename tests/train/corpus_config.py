"""A training config over a small corpus written into the test's folder (the pretraining and
MLM tests build theirs this way)."""

from pathlib import Path


def corpus_config(cls, tmp_path: Path, text: str, base: dict, **overrides):
    """`cls(**base, data=<tmp_path/corpus.txt holding text>, **overrides)`."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "corpus.txt"
    data.write_text(text)
    return cls(**({"data": str(data)} | base | overrides))
