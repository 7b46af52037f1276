"""The server's guards on loopback: body size, read deadlines, queue limit, lone surrogates,
Host check, and the API key on every route. Raw sockets where the test needs to control what
arrives when; every wait on the server is bounded (socket timeouts, counters with deadlines)."""

import http.client
import json
import socket
import statistics
import threading
import time

import pytest
import requests

from lmforge.serve.app import create_app

psutil = pytest.importorskip("psutil")

MiB = 1024 * 1024
BIG = 20 * MiB
COMPLETION = {"prompt": "hello there", "max_tokens": 2, "temperature": 0}


def _gated(engine) -> threading.Event:
    """Make the engine's steps wait while the returned event is clear (it starts set)."""
    gate, step = threading.Event(), engine.step
    gate.set()

    def gated_step():
        gate.wait(timeout=60)
        return step()

    engine.step = gated_step
    return gate


@pytest.fixture(scope="module")
def guarded(make_engine, live_server):
    """A key-less loopback server: 1 MiB bodies, 2 decode slots and 1 queued sample at most."""
    engine = make_engine(max_batch=2)
    gate = _gated(engine)
    app = create_app(engine, "tiny", max_tokens_limit=64, max_body_bytes=MiB, max_queue=1)
    live = live_server(app)
    live.app, live.engine, live.gate = app, engine, gate
    return live


@pytest.fixture(scope="module")
def impatient(make_engine, live_server):
    """A server with half-second read and keep-alive timeouts."""
    app = create_app(make_engine(), "tiny", max_tokens_limit=8, read_timeout=0.5)
    return live_server(app, read_timeout=0.5, keep_alive_timeout=0.5)


# ---- raw HTTP -------------------------------------------------------------------------------
def _connect(live, timeout: float = 30) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port), timeout=timeout)


def _head(live, path="/v1/completions", method="POST", **headers) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{live.port}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset, which follows
    data the client sent after the server closed, ends it too)."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _status_and_body(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


def _send_quietly(sock: socket.socket, data: bytes) -> bool:
    """Send, or False once the server has closed the connection."""
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


# ---- body size ------------------------------------------------------------------------------
class _HealthProbe:
    """GET /health back to back on one keep-alive connection, each latency recorded."""

    def __init__(self, live):
        self.conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)
        self.latencies: list[float] = []
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            start = time.perf_counter()
            self.conn.request("GET", "/health")
            response = self.conn.getresponse()
            assert response.status == 200 and response.read()
            self.latencies.append(time.perf_counter() - start)

    def wait_for(self, count: int) -> None:
        deadline = time.time() + 60
        while len(self.latencies) < count and time.time() < deadline and self.thread.is_alive():
            time.sleep(0.005)
        assert len(self.latencies) >= count, "the /health probe stopped getting answers"

    def stop(self) -> None:
        self.running = False
        self.thread.join(timeout=60)
        self.conn.close()


def _send_big_body(live, chunked: bool) -> tuple[int, dict, dict]:
    """POST a 20 MB body (declared, or chunked without a length), pushing it until the server
    answers or closes; returns its answer."""
    sock = _connect(live)
    if chunked:
        sock.sendall(_head(live, Content_Type="application/json", Transfer_Encoding="chunked"))
        piece = b"10000\r\n" + b"a" * 0x10000 + b"\r\n"
    else:
        sock.sendall(_head(live, Content_Type="application/json", Content_Length=BIG))
        piece = b"a" * 0x10000
    sender = threading.Thread(
        target=lambda: all(_send_quietly(sock, piece) for _ in range(BIG // 0x10000)),
        daemon=True,
    )  # fmt: skip
    sender.start()
    try:
        return _status_and_body(_read_all(sock))
    finally:
        sock.close()
        sender.join(timeout=60)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_20mb_body_is_refused_without_stalling_or_growing_the_server(guarded, chunked):
    """413 for a 20 MB body, /health answered meanwhile within 100 ms of its usual latency, and
    the process (server included: it runs in a thread here) no more than 50 MB larger. A stall
    the server causes repeats, scheduler noise on a shared machine rarely does: the latency
    check passes if one of three rounds stays within the bound; 413 and memory hold in all."""
    requests.post(f"{guarded.url}/v1/completions", json=COMPLETION).raise_for_status()  # warm
    process = psutil.Process()
    stalls = []
    for _ in range(3):
        rss = process.memory_info().rss
        probe = _HealthProbe(guarded)
        try:
            probe.wait_for(20)
            usual = statistics.median(probe.latencies)
            before = len(probe.latencies)
            status, headers, body = _send_big_body(guarded, chunked)
            probe.wait_for(len(probe.latencies) + 5)  # some answers after the refusal too
            stalls.append(max(probe.latencies[before:]) - usual)
        finally:
            probe.stop()
        assert status == 413 and headers["connection"] == "close"
        assert body["error"]["code"] == "request_too_large"
        assert process.memory_info().rss - rss < 50 * MiB
        if stalls[-1] < 0.1:
            break
    assert min(stalls) < 0.1, f"/health stalled {stalls} s"


def test_long_prompt_is_refused_before_tokenizing_and_tokenizing_leaves_the_loop(
    guarded, monkeypatch
):
    tok = guarded.engine.tokenizer
    calls = []
    encode = tok.encode

    def spy(text, *args, **kwargs):
        calls.append((len(text), threading.current_thread()))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", spy)
    url = f"{guarded.url}/v1"
    r = requests.post(f"{url}/completions", json={"prompt": "hello " * 100_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    messages = [{"role": "user", "content": "hello " * 100_000}]
    r = requests.post(f"{url}/chat/completions", json={"messages": messages})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert calls == []  # neither 600,000-character text was tokenized
    assert requests.post(f"{url}/completions", json=COMPLETION).status_code == 200
    assert len(calls) == 1 and calls[0][1] is not guarded.thread  # not the event loop's thread


# ---- lone surrogates ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 1}', "stop.0"),
        ("/v1/completions", b'{"prompt": "hi", "\\ud800": 1}', "body"),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "x\\udc00"}], "max_tokens": 1}',
         "messages.0.content"),
    ],
)  # fmt: skip
def test_lone_surrogate_is_a_400_and_the_connection_stays(guarded, path, body, param):
    conn = http.client.HTTPConnection("127.0.0.1", guarded.port, timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    sock = conn.sock
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 400, error
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == "invalid_unicode"
    assert "surrogate" in error["message"]
    conn.request("GET", "/health")  # same connection, still open
    assert conn.getresponse().status == 200 and conn.sock is sock
    conn.close()


def test_surrogate_pair_and_cesu_bytes(guarded):
    url = f"{guarded.url}/v1/completions"
    headers = {"Content-Type": "application/json"}
    paired = b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 1}'  # one emoji: valid
    assert requests.post(url, data=paired, headers=headers).status_code == 200
    cesu = b'{"prompt": "hi \xed\xa0\x80", "max_tokens": 1}'  # a surrogate as raw bytes
    r = requests.post(url, data=cesu, headers=headers)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- queue limit ----------------------------------------------------------------------------
def test_full_queue_gets_429_with_retry_after(guarded):
    admission, url = guarded.app.state.admission, f"{guarded.url}/v1/completions"
    results = []

    def stream():
        body = {**COMPLETION, "max_tokens": 4, "stream": True}
        with requests.post(url, json=body, stream=True, timeout=120) as r:
            results.append((r.status_code, b"data: [DONE]" in r.content))

    guarded.gate.clear()  # the engine holds every request it gets
    threads = [threading.Thread(target=stream) for _ in range(3)]  # 2 in the batch + 1 queued
    try:
        [t.start() for t in threads]
        deadline = time.time() + 60
        while admission.active < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert admission.active == 3
        r = requests.post(url, json=COMPLETION)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        assert requests.get(f"{guarded.url}/health").status_code == 200
    finally:
        guarded.gate.set()
        [t.join(timeout=120) for t in threads]
    assert results == [(200, True)] * 3
    deadline = time.time() + 60
    while admission.active and time.time() < deadline:  # given back as the responses end
        time.sleep(0.01)
    assert admission.active == 0
    assert requests.post(url, json=COMPLETION).status_code == 200


# ---- slow clients ---------------------------------------------------------------------------
def test_stalled_body_times_out_while_others_are_served(impatient):
    slow = _connect(impatient)
    slow.sendall(_head(impatient, Content_Type="application/json", Content_Length=100))
    slow.sendall(b'{"prompt": ')  # and nothing more
    assert requests.get(f"{impatient.url}/health").status_code == 200
    r = requests.post(f"{impatient.url}/v1/completions", json=COMPLETION)
    assert r.status_code == 200 and r.json()["choices"]
    status, headers, body = _status_and_body(_read_all(slow))  # returns once closed
    assert status == 408 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_timeout"
    slow.close()


def test_trickled_body_times_out(impatient):
    sock = _connect(impatient)
    sock.sendall(_head(impatient, Content_Type="application/json", Content_Length=1000))
    sock.settimeout(0.05)  # one byte about every 50 ms: the body would take ~50 s
    sent, raw = 0, b""
    while sent < 1000:
        if not _send_quietly(sock, b" "):
            break
        sent += 1
        try:
            raw = sock.recv(65536)
            break
        except TimeoutError:
            continue
    sock.settimeout(30)
    raw += _read_all(sock)
    sock.close()
    assert sent < 1000
    assert _status_and_body(raw)[0] == 408


def test_slow_or_missing_head_and_idle_keep_alive_are_closed(impatient):
    silent = _connect(impatient)  # connects, never sends
    partial = _connect(impatient)
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # head never finished
    trickle = _connect(impatient)
    trickle.sendall(b"GET /health HTTP/1.1\r\nX-Pad: ")
    sent = 0
    while sent < 1000 and _send_quietly(trickle, b"a"):  # ~50 s of header at this pace
        sent += 1
        time.sleep(0.05)
    assert sent < 1000
    idle = _connect(impatient)
    idle.sendall(_head(impatient, "/health", "GET"))
    answer = b""
    while not answer.endswith(b'{"status":"ok"}'):  # one whole response, connection kept
        answer += idle.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200")
    for sock in (silent, partial, idle):
        assert _read_all(sock) == b""  # closed by the server, nothing sent
        sock.close()
    trickle.close()


# ---- Host and API key -----------------------------------------------------------------------
@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.2", "[::2]:80"])
def test_keyless_server_refuses_foreign_host(guarded, host):
    for path in ("/health", "/v1/models", "/docs"):
        r = requests.get(f"{guarded.url}{path}", headers={"Host": host})
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
        assert "DNS-rebinding" in r.json()["error"]["message"]


def test_keyless_server_answers_loopback_names(guarded):
    port = guarded.port
    for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"LOCALHOST:{port}",
                 "[::1]", f"[::1]:{port}"):  # fmt: skip
        r = requests.get(f"{guarded.url}/v1/models", headers={"Host": host})
        assert r.status_code == 200, host


def test_key_guards_every_route_but_health_and_the_page(server, api_key):
    auth = {"Authorization": f"Bearer {api_key}"}
    for path in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
        r = requests.get(f"{server.url}{path}")
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", path
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert requests.get(f"{server.url}{path}", headers=auth).status_code == 200, path
    for path in ("/health", "/", "/static/index.html"):
        assert requests.get(f"{server.url}{path}").status_code == 200, path
    # with a key, a foreign Host is let through: the key is what a rebinding page lacks
    r = requests.get(f"{server.url}/v1/models", headers={**auth, "Host": "evil.example"})
    assert r.status_code == 200
