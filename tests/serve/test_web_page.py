"""The chat page in real Chromium (Debian's, driven by Playwright): type and watch the reply
stream, stop, edit and regenerate into branches, switch conversations, reload and find the
history on the server, attach a file, answer from documents with cited passages, and render
markdown with highlighted code and KaTeX math (the screenshot in docs/img/)."""

import re
import shutil
import time
from pathlib import Path

import pytest
import requests
import torch

from lmforge.infer.engine import Engine
from lmforge.lm import LM
from lmforge.model.config import ModelConfig
from lmforge.serve.app import create_app
from lmforge.tokenizer import Tokenizer

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]  # fmt: skip
TEXT = "hello there, how are you today? I am fine. The quick brown fox jumps over the lazy dog. "
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "chat-page.png"
DOCS = [("Foxes", "The red fox lives in forests and eats small rodents."),
        ("Dogs", "The lazy dog sleeps all day next to the fire.")]  # fmt: skip
RENDERED = (
    "Here is code and a formula.\n\n```python\ndef area(r):\n    return 3.14159 * r ** 2\n```\n\n"
    "The area is $A = \\pi r^2$, and in general\n\n$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$"
)


@pytest.fixture(scope="module")
def server(live_server, api_key, tmp_path_factory):
    """A key-protected server over a tiny random model (a 512-token context, decode steps paced
    10 ms apart so the page sees a reply grow), with a SQLite history and a BM25 index."""
    from lmforge.retrieval.chunking import Chunk
    from lmforge.retrieval.retriever import Retriever

    torch.manual_seed(0)
    tok = Tokenizer.train_bpe([TEXT * 20], vocab_size=300)
    config = ModelConfig.from_preset("llama-micro", vocab_size=tok.vocab_size, max_seq_len=512)
    engine = Engine.from_lm(LM.from_config(config, tokenizer=tok, seed=0), max_batch=4)
    step = engine.step
    engine.step = lambda: (time.sleep(0.01), step())[1]
    folder = tmp_path_factory.mktemp("page")
    chunks = [Chunk(i, f"{t.lower()}.txt", t, text, 0) for i, (t, text) in enumerate(DOCS)]
    Retriever.build(chunks, encoder=None).save(folder / "index")
    app = create_app(engine, "tiny-chat", api_key=api_key, max_tokens_limit=24,
                     stream_interval=0, history=folder / "h.sqlite3",
                     rag_index=folder / "index")  # fmt: skip
    return live_server(app)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip("Chromium not installed (apt-get install -y chromium); page test skipped")
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, server, api_key):
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    page.goto(server.url)
    page.fill("#api-key", api_key)
    page.dispatch_event("#api-key", "change")
    yield page
    context.close()
    assert not errors, errors


def ask(page, text: str) -> None:
    count = page.locator(".assistant[data-done='true']").count()
    page.fill("#input", text)
    page.press("#input", "Enter")
    page.wait_for_function(
        f"document.querySelectorAll(\".assistant[data-done='true']\").length > {count}"
        " && !document.getElementById('send').disabled", timeout=120_000)  # fmt: skip


def test_typed_message_streams_and_the_model_and_speed_show(page):
    page.wait_for_function("document.getElementById('model-name').textContent === 'tiny-chat'")
    page.evaluate("""() => {
        window.updates = 0;
        new MutationObserver(() => { window.updates += 1; })
            .observe(document.getElementById('log'),
                     {childList: true, subtree: true, characterData: true});
    }""")
    ask(page, "hello there, how are you?")
    assert page.inner_text(".user .body") == "hello there, how are you?"
    assert page.inner_text(".assistant .body").strip()
    assert page.locator(".error").count() == 0
    assert page.evaluate("window.updates") >= 4  # the reply grew token by token
    assert "tokens/s" in page.inner_text(".assistant .tools")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")


def test_stop_ends_the_stream(page):
    page.evaluate("""() => new MutationObserver((_, observer) => {
        const reply = document.querySelector('.assistant .body');
        if (reply && reply.textContent.length) {
            observer.disconnect();
            document.getElementById('stop').click();
        }
    }).observe(document.getElementById('log'),
               {childList: true, subtree: true, characterData: true})""")
    ask(page, "the quick brown fox")
    # Under load the click can land before the first token: the reply then shows no count.
    label = re.search(r"(\d+) tokens", page.inner_text(".assistant .tools"))
    assert (int(label[1]) if label else 0) < 24  # stopped before max_tokens
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    assert page.locator(".error").count() == 0


def test_edit_and_regenerate_make_branches(page):
    ask(page, "first question")
    first_reply = page.inner_text(".assistant .body")
    page.click(".assistant .regenerate")
    page.wait_for_function(
        "document.querySelector('.assistant .branch')?.textContent === '2/2'"
        " && !document.getElementById('send').disabled",
        timeout=120_000,
    )
    page.click(".assistant .prev")
    assert page.inner_text(".assistant .body") == first_reply
    page.click(".user .edit")
    page.fill(".edit-box", "second question")
    page.press(".edit-box", "Enter")
    page.wait_for_function(
        "document.querySelector('.user .branch')?.textContent === '2/2'"
        " && !document.getElementById('send').disabled",
        timeout=120_000,
    )
    assert page.inner_text(".user .body") == "second question"
    page.click(".user .prev")
    assert page.inner_text(".user .body") == "first question"


def test_conversations_switch_and_survive_a_reload(page, server, api_key):
    ask(page, "remember the fox")
    page.click("#reset")
    assert page.locator(".msg").count() == 0
    ask(page, "about the dog")
    page.wait_for_function("document.querySelectorAll('#conversations li').length >= 2")
    page.click("#conversations li:has-text('remember the fox')")
    page.wait_for_function("document.querySelector('.user .body')?.textContent === "
                           "'remember the fox'")  # fmt: skip
    page.reload()
    page.fill("#api-key", api_key)  # kept in localStorage too; the fill is a no-op then
    page.wait_for_function("document.querySelector('.user .body')?.textContent === "
                           "'remember the fox'", timeout=30_000)  # fmt: skip
    stored = requests.get(f"{server.url}/api/conversations", timeout=30,
                          headers={"Authorization": f"Bearer {api_key}"}).json()  # fmt: skip
    titles = [c["title"] for c in stored["conversations"]]
    assert "remember the fox" in titles and "about the dog" in titles


def test_attached_text_file_goes_with_the_message(page, tmp_path, server, api_key):
    note = tmp_path / "note.txt"
    note.write_text("the secret word is fox")
    page.click("#reset")
    page.set_input_files("#attach", str(note))
    page.wait_for_function("document.getElementById('attachments').textContent.includes("
                           "'note.txt')")  # fmt: skip
    ask(page, "what is the secret word?")
    stored = requests.get(f"{server.url}/api/conversations", timeout=30,
                          headers={"Authorization": f"Bearer {api_key}"}).json()  # fmt: skip
    newest = requests.get(
        f"{server.url}/api/conversations/{stored['conversations'][0]['id']}",
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    ).json()
    contents = [n["content"] for n in newest["data"]["nodes"].values() if n["role"] == "user"]
    assert any("the secret word is fox" in c and "note.txt" in c for c in contents)


def test_answer_from_documents_shows_passages(page):
    page.click("#reset")
    page.check("#rag")
    ask(page, "where does the red fox live?")
    text = page.inner_text(".assistant .passages")
    assert "forests" in text  # BM25 finds the fox passage; it is shown under the answer


def test_markdown_code_and_math_render(page, server, api_key):
    node = {"id": "a", "parent": None, "role": "user", "content": "show me", "children": ["b"],
            "meta": {}}  # fmt: skip
    reply = {"id": "b", "parent": "a", "role": "assistant", "content": RENDERED, "children": [],
             "meta": {"tokens": 42, "tps": 31.5}}  # fmt: skip
    data = {"nodes": {"a": node, "b": reply}, "roots": ["a"], "leaf": "b", "system": ""}
    made = requests.post(f"{server.url}/api/conversations", timeout=30,
                         json={"title": "Circle area", "data": data},
                         headers={"Authorization": f"Bearer {api_key}"}).json()  # fmt: skip
    page.reload()
    page.click(f"#conversations li[data-id='{made['id']}']")
    page.wait_for_selector(".assistant pre code.hljs")
    assert page.locator(".assistant .hljs-keyword").count() >= 1  # `def`, `return` coloured
    assert page.locator(".assistant .katex-display").count() == 1
    assert page.locator(".assistant .katex").count() == 2
    assert "$" not in page.inner_text(".assistant .body")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT))
