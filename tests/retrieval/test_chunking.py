"""Chunking: windows, sources and titles, and the bad-input cases (binary, undecodable, empty)."""

import json

import pytest

from lmforge.errors import ConfigError, DataError
from lmforge.retrieval.chunking import Document, chunk_corpus, chunk_documents, windows


def test_word_windows_overlap_and_cover_every_word():
    text = " ".join(f"w{i}" for i in range(10))
    got = windows(text, size=4, overlap=2)
    assert [s for s, _ in got] == [0, 2, 4, 6]
    assert got[0][1] == "w0 w1 w2 w3" and got[-1][1] == "w6 w7 w8 w9"
    for (_, a), (_, b) in zip(got, got[1:]):
        assert a.split()[-2:] == b.split()[:2]  # adjacent windows share `overlap` words


def test_windows_keep_original_spacing_and_short_texts_whole():
    assert windows("a  b\nc", size=10, overlap=3) == [(0, "a  b\nc")]
    assert windows("   ", size=5, overlap=1) == []


def test_char_windows():
    assert windows("abcdefg", size=3, overlap=1, unit="char") == [
        (0, "abc"),
        (2, "cde"),
        (4, "efg"),
    ]


@pytest.mark.parametrize("size,overlap,unit", [(0, 0, "word"), (4, 4, "word"), (4, 1, "token")])
def test_bad_window_settings(size, overlap, unit):
    with pytest.raises(ConfigError):
        windows("a b c", size, overlap, unit)


def test_chunks_carry_source_title_and_sequential_ids():
    docs = [Document("d1", "One", "a b c d e"), Document("d2", "Two", "f g")]
    chunks = chunk_documents(docs, size=3, overlap=1)
    assert [c.id for c in chunks] == list(range(len(chunks)))
    assert [(c.source, c.title, c.text) for c in chunks] == [
        ("d1", "One", "a b c"),
        ("d1", "One", "c d e"),
        ("d2", "Two", "f g"),
    ]


def test_folder_skips_binary_and_undecodable_files_by_name(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "good.md").write_text("# Good title\nsome useful words here", encoding="utf-8")
    (tmp_path / "sub" / "notes.txt").write_text("more words", encoding="utf-8")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\x00\x00\x01binary")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    chunks, corpus = chunk_corpus(tmp_path, size=50, overlap=5)
    assert {c.source for c in chunks} == {"good.md", "sub/notes.txt"}
    assert {c.title for c in chunks} == {"Good title", "more words"}
    assert len(corpus.skipped) == 2
    msg = corpus.skip_message()
    assert "skipped 2" in msg and "image.png (binary)" in msg and "latin1.txt (not UTF-8" in msg


def test_nothing_left_is_a_clear_error(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(DataError, match=r"no text to index \(skipped 1 file\(s\): a.bin"):
        chunk_corpus(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no text to index"):
        chunk_corpus(empty)
    (tmp_path / "blank.txt").write_text("  \n ")
    with pytest.raises(DataError, match="no text to index"):
        chunk_corpus(tmp_path / "blank.txt")


def test_single_binary_file_and_missing_source(tmp_path):
    (tmp_path / "x.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DataError, match="binary"):
        chunk_corpus(tmp_path / "x.txt")
    with pytest.raises(DataError, match="corpus not found"):
        chunk_corpus(tmp_path / "nope")
    with pytest.raises(DataError, match="unknown builtin"):
        chunk_corpus("builtin:nope")


def test_jsonl_ids_titles_and_bad_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"id": "faq-1", "title": "Reset", "text": "How to reset a password"}, {"text": "x y"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    chunks, _ = chunk_corpus(path)
    assert [(c.source, c.title) for c in chunks] == [
        ("faq-1", "Reset"),
        ("docs.jsonl:2", "docs.jsonl:2"),
    ]
    path.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"docs.jsonl:2: .*'text'"):
        chunk_corpus(path)


def test_builtin_pydoc_titles_are_topic_keys():
    from pydoc_data.topics import topics

    chunks, corpus = chunk_corpus("builtin:pydoc", size=120, overlap=30)
    assert len(corpus.documents) == len(topics)
    assert len(chunks) > len(topics)
    assert {c.title for c in chunks} == set(topics)
    assert all(c.source == f"pydoc:{c.title}" for c in chunks)
