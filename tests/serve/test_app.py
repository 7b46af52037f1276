"""The OpenAI-compatible server, driven by the official `openai` client and raw HTTP."""

import threading
import time

import pytest
import requests

from lmforge.infer.engine import GenerationParams

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server, api_key):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert requests.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_greedy_is_deterministic_and_matches_the_engine(server, client, make_engine):
    kw = dict(model="tiny", prompt="hello there", max_tokens=12, temperature=0, logprobs=0)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    # The oracle: the engine's own greedy run (a second engine over the same weights; the
    # server's engine belongs to its stepping thread).
    greedy = GenerationParams(max_new_tokens=12, temperature=0)
    (ref,) = make_engine().generate(["hello there"], greedy)
    tok = server.engine.tokenizer
    assert ref.text.strip()  # something to compare
    assert a.choices[0].text == ref.text
    assert a.choices[0].logprobs.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert a.choices[0].finish_reason == ref.finish_reason
    assert a.usage.completion_tokens == len(ref.token_ids)
    assert a.usage.prompt_tokens == len(ref.prompt_ids) == len(tok.encode("hello there"))


def test_completion_stream_equals_non_stream(client):
    kw = dict(model="tiny", prompt="the quick", max_tokens=16, temperature=0.9, seed=7)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_stream_n_logprobs_and_stop(client):
    messages = [{"role": "user", "content": "how are you?"}]
    kw = dict(model="tiny", messages=messages, max_tokens=10, temperature=1.0, seed=1, n=2)
    full = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw)
    assert [c.index for c in full.choices] == [0, 1]
    lp = full.choices[0].logprobs.content
    assert lp and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp)
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {c.index: c.message.content for c in full.choices}
    text = full.choices[0].message.content
    if len(text) > 3:  # a stop string cuts the text right before it
        cut = client.chat.completions.create(stop=[text[2:4]], **{**kw, "n": 1})
        assert cut.choices[0].message.content == text[: text.index(text[2:4])]


def error_of(response: requests.Response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b'{"prompt": "hi", "max_tokens": ', 400, None),
        (b'{"prompt": "hi", "bogus": 1}', 400, "bogus"),
        (b'{"prompt": "hi", "max_tokens": "8"}', 400, "max_tokens"),
        (b'{"prompt": "hi", "temperature": 9}', 400, "temperature"),
        (b'{"prompt": "hi", "max_tokens": 65}', 400, "max_tokens"),
        (b'{"prompt": "' + b"hello " * 200 + b'"}', 400, "prompt"),
        (b'{"prompt": ""}', 400, "prompt"),
        (b'{"prompt": "hi", "model": "other"}', 404, "model"),
        (b"[1, 2]", 400, None),
    ],
)
def test_bad_completion_requests_get_openai_errors(server, api_key, body, status, param):
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    r = requests.post(f"{server.url}/v1/completions", data=body, headers=headers)
    assert r.status_code == status
    assert error_of(r)["param"] == param


def test_bad_chat_requests_and_auth(server, api_key):
    url = f"{server.url}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {api_key}"}
    r = requests.post(url, json={"messages": []}, headers=auth)
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    r = requests.post(url, json={"messages": [{"role": "robot", "content": "x"}]}, headers=auth)
    assert r.status_code == 400
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        body = {"messages": [{"role": "user", "content": "x"}]}
        r = requests.post(url, json=body, headers=headers)
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    assert requests.get(f"{server.url}/health").status_code == 200  # still serving


def test_concurrent_requests_share_the_batch(server, client):
    """Six requests sent together decode in one batch: the engine's first step is held until
    all six are queued (a wait on the engine's state, not on time), then one step must take
    them all into the batch."""
    engine, rows_after_step = server.engine, []
    original = engine.step
    all_queued = threading.Event()

    def gated():
        if not rows_after_step:  # the first step waits for the whole group
            deadline = time.time() + 60
            while len(engine.rows) + len(engine.waiting) < 6 and time.time() < deadline:
                time.sleep(0.01)
            all_queued.set()
        out = original()
        rows_after_step.append(len(engine.rows))
        return out

    engine.step = gated
    try:
        results = [None] * 6

        def call(i):
            r = client.completions.create(model="tiny", prompt="hi " * (i + 1), max_tokens=24,
                                          temperature=0)  # fmt: skip
            results[i] = r.choices[0].text

        threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        engine.step = original
    assert all_queued.is_set() and all(r is not None for r in results)
    assert rows_after_step[0] == 6  # all six prefilled together and decoding in one batch


def test_disconnect_frees_the_slot(server, api_key):
    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"prompt": "hello", "max_tokens": 64, "stream": True, "stop": [], "temperature": 0.5}
    url = f"{server.url}/v1/completions"
    with requests.post(url, json=body, headers=headers, stream=True) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i >= 2:
                break
    deadline = time.time() + 20
    while server.engine.has_work() and time.time() < deadline:
        time.sleep(0.05)
    assert not server.engine.has_work()
