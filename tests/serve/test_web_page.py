"""The chat page in headless Chromium: type a message, watch the reply stream in."""

import shutil
import time

import pytest

from lmforge.serve.app import create_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]  # fmt: skip


@pytest.fixture(scope="module")
def paced_server(make_engine, live_server, api_key):
    """The test server, its decode steps paced 10 ms apart: the page must show the reply grow
    token by token, which a tiny model on a quiet machine could otherwise finish in one chunk."""
    engine = make_engine()
    step = engine.step
    engine.step = lambda: (time.sleep(0.01), step())[1]
    app = create_app(engine, "tiny", api_key=api_key, max_tokens_limit=64, stream_interval=0)
    return live_server(app)


@pytest.fixture(scope="module")
def page(paced_server):
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not shutil.which("chromium"):
        pytest.skip("Chromium not installed (apt-get install -y chromium); page test skipped")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page()
        page.goto(paced_server.url)
        yield page
        browser.close()


def test_typed_message_gets_a_streamed_reply(page, api_key):
    page.fill("#api-key", api_key)
    page.dispatch_event("#api-key", "change")
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0.8")
    # Count how many times the reply's text changes while it streams.
    page.evaluate("""() => {
        window.updates = 0;
        new MutationObserver(() => { window.updates += 1; })
            .observe(document.getElementById('log'),
                     {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#input", "hello there, how are you?")
    page.press("#input", "Enter")
    page.wait_for_selector(".assistant[data-done='true']", timeout=60_000)
    assert page.inner_text(".user") == "hello there, how are you?"
    assert page.inner_text(".assistant").strip()
    assert page.locator(".error").count() == 0
    assert page.evaluate("window.updates") >= 4  # user bubble, reply bubble, 2+ token updates
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
