"""RAG: prompts that fit the context window, extractive answers, citations, and the CLI."""

import pytest

from lmforge.cli.main import main
from lmforge.errors import ConfigError
from lmforge.retrieval import RAG, Retriever
from lmforge.retrieval.chunking import Document, chunk_corpus, chunk_documents

DOCS = [
    Document("loops", "Loops", "The break statement leaves the nearest enclosing loop early. " * 3),
    Document("funcs", "Functions", "A def statement defines a function with its parameters. " * 3),
    Document("dicts", "Dicts", "A dictionary maps keys to values; get returns a default value."),
]


@pytest.fixture(scope="module")
def pydoc_bm25():
    chunks, _ = chunk_corpus("builtin:pydoc", 120, 30)
    return Retriever.build(chunks, encoder=None)


@pytest.fixture
def retriever():
    return Retriever.build(chunk_documents(DOCS, 200, 20), encoder=None)


def test_prompt_fits_the_window_and_says_when_it_truncates(tiny_lm, retriever):
    rag = RAG(retriever, tiny_lm, k=3, mode="bm25", max_new_tokens=8)
    hits = rag.retrieve("loop function dictionary")
    prompt, placed, notes = rag.answerer.build_prompt("What does break do?", hits)
    # 128-token window: 81 tokens of instruction + question leave room for part of one chunk
    assert len(tiny_lm.tokenizer.encode(prompt)) + 8 <= tiny_lm.config.max_seq_len
    assert prompt.endswith("Question: What does break do?\nAnswer:")
    assert prompt.index("[1] Loops\nThe break statement") < prompt.index("Question:")
    assert [h.chunk.source for h in placed] == ["loops"]
    assert notes[0].startswith("chunk [1] truncated to")
    assert notes[1] == f"context window of 128 tokens: kept 1 of {len(hits)} chunks"


def test_lm_answer_returns_text_and_only_placed_sources(tiny_lm, retriever):
    answer = RAG(retriever, tiny_lm, k=2, mode="hybrid", max_new_tokens=8).ask("break loop")
    assert isinstance(answer.text, str)
    assert answer.sources and all(h.chunk.title in answer.prompt for h in answer.sources)
    assert "mode 'hybrid' needs embeddings: used bm25" in answer.notes
    assert "Sources:\n[1] Loops (loops" in answer.format()


def test_question_longer_than_the_window_is_a_clear_error(tiny_lm, retriever):
    rag = RAG(retriever, tiny_lm, mode="bm25", max_new_tokens=24)
    with pytest.raises(ConfigError, match="question takes .* tokens but only 104 fit"):
        rag.ask("loop " * 200)


def test_extractive_answer_cites_the_right_pydoc_topic(pydoc_bm25):
    answer = RAG(pydoc_bm25, k=5, mode="bm25").ask("What does the nonlocal statement do?")
    assert answer.sources[0].chunk.source == "pydoc:nonlocal"
    assert "[1]" in answer.text and "nonlocal" in answer.text
    answer = RAG(pydoc_bm25, k=5, mode="bm25").ask("How is the assert statement equivalent to if?")
    assert answer.sources[0].chunk.source == "pydoc:assert"


def test_cli_index_and_ask(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "loops.md").write_text("# Loops\nThe break statement leaves a loop.")
    (tmp_path / "docs" / "blob.bin").write_bytes(b"\x00\x01")
    out = tmp_path / "idx"
    assert main(["rag", "index", "--corpus", str(tmp_path / "docs"), "--out", str(out),
                 "--encoder", "none"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "indexed 1 chunks from 1 documents (bm25)" in captured.out
    assert "skipped 1 file(s): blob.bin (binary)" in captured.err
    assert main(["rag", "ask", "--index", str(out), "--question", "how to leave a loop"]) == 0
    printed = capsys.readouterr().out
    assert "The break statement leaves a loop. [1]" in printed
    assert "[1] Loops (loops.md" in printed


def test_cli_missing_index_and_empty_corpus(tmp_path, capsys):
    assert main(["rag", "ask", "--index", str(tmp_path / "none"), "--question", "q"]) == 2
    assert "error: no retrieval index at" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["rag", "index", "--corpus", str(tmp_path / "empty"), "--out", "x"]) == 2
    assert "no text to index" in capsys.readouterr().err
