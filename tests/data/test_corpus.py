import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmforge.data import builtin_corpus, read_documents
from lmforge.errors import DataError


def test_pydoc_corpus_is_nonempty_and_deterministic():
    docs = builtin_corpus("pydoc")
    assert len(docs) > 50
    assert sum(map(len, docs)) > 300_000
    assert docs == builtin_corpus()
    assert list(read_documents("builtin:pydoc")) == [d for d in docs if d.strip()]


def test_shakespeare_from_env_and_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("LMFORGE_SHARED_DATA", str(tmp_path))
    with pytest.raises(DataError, match="tinyshakespeare.txt"):
        builtin_corpus("shakespeare")
    (tmp_path / "tinyshakespeare.txt").write_text("First Citizen:\nBefore we proceed")
    assert builtin_corpus("shakespeare") == ["First Citizen:\nBefore we proceed"]
    with pytest.raises(DataError, match="unknown builtin corpus"):
        list(read_documents("builtin:nope"))


def test_real_shakespeare(shared_data, monkeypatch):
    monkeypatch.delenv("LMFORGE_SHARED_DATA", raising=False)
    (text,) = builtin_corpus("shakespeare")
    assert len(text) == 1_115_394 and text.startswith("First Citizen")


def test_text_file_and_folder(tmp_path):
    (tmp_path / "b.md").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "nul.txt").write_bytes(b"abc\x00def")
    (tmp_path / "skip.json").write_text("{}")
    assert list(read_documents(tmp_path / "a.txt")) == ["first"]
    with pytest.warns(UserWarning, match="skipped 2"):
        assert list(read_documents(tmp_path)) == ["first", "second", "third"]
    with pytest.raises(DataError, match="bad.txt: not UTF-8"):
        read_documents(tmp_path / "bad.txt")


def test_jsonl(tmp_path):
    rows = [{"text": "one"}, {"text": ""}, {"body": "x", "text": "two"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(read_documents(path)) == ["one", "two"]
    gz = tmp_path / "d.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"chosen": "c"}) + "\n")
    assert list(read_documents(gz, text_field="chosen")) == ["c"]


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "bad",}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: invalid JSON"):
        list(read_documents(path))
    path.write_text('{"text": "ok"}\n\n{"content": "x"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:3: missing field 'text'"):
        list(read_documents(path))
    path.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:1: field 'text' must be a string"):
        list(read_documents(path))


def test_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["alpha", None, "beta"], "n": [1, 2, 3]}), path)
    assert list(read_documents(path)) == ["alpha", "beta"]
    with pytest.raises(DataError, match="no column 'body'.*text, n"):
        list(read_documents(path, text_field="body"))


def test_bad_sources(tmp_path):
    with pytest.raises(DataError, match="not found: .*missing.txt"):
        read_documents(tmp_path / "missing.txt")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported"):
        read_documents(tmp_path / "x.csv")
    (tmp_path / "blank.txt").write_text("\n\n  ")
    with pytest.raises(DataError, match="no non-empty documents"):
        list(read_documents(tmp_path / "blank.txt"))
    with pytest.raises(DataError, match="hf:NAME"):
        read_documents("hf:")
