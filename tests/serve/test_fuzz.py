"""Schemathesis fuzzes the API from its own OpenAPI spec: whatever it sends, never a 5xx."""

import pytest
import requests

from lmforge.serve.app import create_app

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES = 25  # per operation: bounded so the test takes seconds


@pytest.fixture(scope="module")
def live(make_engine, live_server, api_key):
    return live_server(create_app(make_engine(), "tiny", api_key=api_key, max_tokens_limit=8))


def fuzz(operation, failures: list, api_key: str) -> None:
    """Send EXAMPLES generated requests to one operation; record 5xx and dropped connections."""

    @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))  # fmt: skip
    @hypothesis.given(operation.as_strategy())
    def check(case):
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {api_key}"}
        try:
            response = case.call(timeout=60)
        except requests.RequestException as err:
            failures.append((operation.path, case.body, "no response", repr(err)))
            return
        if response.status_code >= 500:
            failures.append((operation.path, case.body, response.status_code, response.text))

    check()


def test_fuzz_never_5xx(live, api_key):
    auth = {"Authorization": f"Bearer {api_key}"}
    assert requests.get(f"{live.url}/openapi.json").status_code == 401  # the key guards it
    schema = schemathesis.openapi.from_dict(requests.get(f"{live.url}/openapi.json",
                                                         headers=auth).json())  # fmt: skip
    schema.config.update(base_url=live.url)
    failures: list = []
    for operation in schema.get_all_operations():
        fuzz(operation.ok(), failures, api_key)
    assert not failures, failures[:3]
    assert requests.get(f"{live.url}/health").status_code == 200
