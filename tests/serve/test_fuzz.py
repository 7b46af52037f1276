"""Schemathesis fuzzes the API from its own OpenAPI spec: whatever it sends, never a 5xx."""

import pytest
import requests
from conftest import API_KEY, LiveServer, tiny_lm

from lmforge.infer.engine import Engine
from lmforge.serve.app import create_app

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES = 25  # per operation: bounded so the test takes seconds


@pytest.fixture(scope="module")
def live():
    engine = Engine.from_lm(tiny_lm(), max_batch=8)
    server = LiveServer(create_app(engine, "tiny", api_key=API_KEY, max_tokens_limit=8))
    yield server
    server.stop()


def fuzz(operation, failures: list) -> None:
    """Send EXAMPLES generated requests to one operation; record 5xx and dropped connections."""

    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))  # fmt: skip
    @hypothesis.given(operation.as_strategy())
    def check(case):
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {API_KEY}"}
        try:
            response = case.call(timeout=60)
        except requests.RequestException as err:
            failures.append((operation.path, case.body, "no response", repr(err)))
            return
        if response.status_code >= 500:
            failures.append((operation.path, case.body, response.status_code, response.text))

    check()


def test_fuzz_never_5xx(live):
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    failures: list = []
    for operation in schema.get_all_operations():
        fuzz(operation.ok(), failures)
    assert not failures, failures[:3]
    assert requests.get(f"{live.url}/health").status_code == 200
