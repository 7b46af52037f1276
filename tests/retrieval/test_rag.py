"""RAG: prompts that fit the context window, extractive answers, citations, and the CLI."""

import pytest

from lmforge.cli.main import main
from lmforge.errors import ConfigError
from lmforge.retrieval import RAG, Retriever
from lmforge.retrieval.chunking import Document, chunk_corpus, chunk_documents
from lmforge.retrieval.rag import EXTRACTIVE_LABEL, Answer, citations, strip_citations

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


def test_prompt_is_a_chat_turn_that_fits_the_window(tiny_lm, retriever):
    from lmforge.interop.chat_template import render_chat
    from lmforge.retrieval.rag import INSTRUCTION

    tok, window = tiny_lm.tokenizer, tiny_lm.config.max_seq_len
    question = "What does break do?"
    fixed = len(tok.encode(RAG(retriever, tiny_lm).answerer.render(question, "")))
    new_tokens = window - fixed - 40  # 40 tokens of room: less than the first chunk needs
    rag = RAG(retriever, tiny_lm, k=3, mode="bm25", max_new_tokens=new_tokens)
    hits = rag.retrieve("loop function dictionary")
    assert len(tok.encode(hits[0].chunk.text)) > 40  # the premise: the first chunk is cut
    prompt, placed, notes = rag.answerer.build_prompt(question, hits)
    assert window - 50 <= len(tok.encode(prompt)) + new_tokens <= window
    # one user turn of the model's chat template, ending in the assistant's reply header
    context = prompt[prompt.index("[1] ") : prompt.index("Question:")]
    message = f"{INSTRUCTION}\n\n{context}Question: {question}"
    assert prompt == render_chat(tok, [{"role": "user", "content": message}], True)
    assert context.startswith("[1] Loops\nThe break statement")
    assert [h.chunk.source for h in placed] == ["loops"]
    assert notes[0].startswith("chunk [1] truncated to")
    assert notes[1] == f"context window of {window} tokens: kept 1 of {len(hits)} chunks"


def test_generated_answer_is_the_models_greedy_continuation(tiny_lm, retriever):
    rag = RAG(retriever, tiny_lm, k=2, mode="hybrid", max_new_tokens=8)
    answer = rag.ask("break loop")
    assert answer.kind == "generated" and rag.kind == "generated"
    # the Engine's batched greedy decode == LM.complete on the same prompt (another code path)
    expected = tiny_lm.complete(answer.prompt, max_new_tokens=8, temperature=0.0)[0]
    assert answer.text == expected.strip()
    assert answer.sources and all(h.chunk.title in answer.prompt for h in answer.sources)
    assert "mode 'hybrid' needs embeddings: used bm25" in answer.notes
    formatted = answer.format()
    assert "Sources:\n[1] Loops (loops" in formatted and "extractive" not in formatted


def test_ask_many_batches_to_the_same_answers_as_one_by_one(tiny_lm, retriever):
    rag = RAG(retriever, tiny_lm, k=2, mode="bm25", max_new_tokens=6)
    questions = ["break loop", "define a function", "dictionary default value"]
    together = rag.ask_many(questions)
    alone = [rag.ask(q) for q in questions]
    assert [a.text for a in together] == [a.text for a in alone]
    assert [[h.chunk.id for h in a.sources] for a in together] == [
        [h.chunk.id for h in a.sources] for a in alone
    ]


def test_citations_map_to_the_numbered_passages(retriever):
    assert citations("Paris [2]. Also [1, 3] and [2] again; [x] is not one") == [2, 1, 3]
    assert strip_citations("Paris [2]. Also [1, 3].") == "Paris . Also ."
    hits = retriever.search("loop function dictionary", 3, "bm25")
    answer = Answer("leaves the loop [2] (see [9])", hits)
    assert answer.cited == [hits[1]]  # [9] names no passage


def test_question_longer_than_the_window_is_a_clear_error(tiny_lm, retriever):
    rag = RAG(retriever, tiny_lm, mode="bm25", max_new_tokens=24)
    with pytest.raises(ConfigError, match="question takes .* tokens but only 296 fit"):
        rag.ask("loop " * 400)


def test_extractive_output_is_labelled_not_an_answer(retriever):
    answer = RAG(retriever, k=2, mode="bm25").ask("how to leave a loop")
    assert answer.kind == "extractive"
    assert answer.format().startswith(f"[{EXTRACTIVE_LABEL}]\nThe break statement")


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
    assert printed.startswith(f"[{EXTRACTIVE_LABEL}]\n")  # never presented as an answer
    assert "The break statement leaves a loop. [1]" in printed
    assert "[1] Loops (loops.md" in printed


def test_cli_ask_with_a_model_folder_generates(tmp_path, capsys, tiny_lm):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "loops.md").write_text("# Loops\nThe break statement leaves a loop.")
    tiny_lm.save(tmp_path / "model")
    idx = tmp_path / "idx"
    assert main(["rag", "index", "--corpus", str(tmp_path / "docs"), "--out", str(idx),
                 "--encoder", "none"]) == 0  # fmt: skip
    capsys.readouterr()
    args = ["rag", "ask", "--index", str(idx), "--question", "how to leave a loop"]
    assert main(args + ["--model", str(tmp_path / "model"), "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    answer = RAG(Retriever.load(idx), tiny_lm, max_new_tokens=5).ask("how to leave a loop")
    assert printed == answer.format() + "\n"
    assert "extractive" not in printed


def test_cli_missing_index_and_empty_corpus(tmp_path, capsys):
    assert main(["rag", "ask", "--index", str(tmp_path / "none"), "--question", "q"]) == 2
    assert "error: no retrieval index at" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["rag", "index", "--corpus", str(tmp_path / "empty"), "--out", "x"]) == 2
    assert "no text to index" in capsys.readouterr().err
