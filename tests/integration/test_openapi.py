"""The proxy's OpenAPI document: it declares the body of every POST route that reads one (the inference
routes and the RL API read theirs by hand, after the key: proxy/bodies.py `openapi_body`), and
schemathesis, fuzzing every operation it documents with valid and invalid requests under an admin key
and a session key, gets no 5xx from the real proxy, on SQLite and Postgres."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core import NOT_SET

from tests.support.log_tap import tapped_logs
from tests.support.proxy_harness import Proxy, ProxyFactory
from tests.support.scripted_worker import ScriptedWorker

EXAMPLES = 12
"""Examples per operation, per key and per mode: the whole fuzz stays within a minute."""
BODIES = {
    "/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input",
    "/rl/v1/sessions": "task", "/rl/v1/groups": "size", "/rl/v1/sessions/{session_id}/reward": "value",
    "/rl/v1/completions/{completion_id}/reward": "value", "/rl/start_session": "task_id",
    "/rl/set_reward": "reward", "/rl/v1/feedback": "value",
}
"""Each POST route that reads a body, and a property its declared schema must have."""


def test_every_post_body_is_declared(proxy: Proxy) -> None:
    document = httpx.get(f"{proxy.base_url}/openapi.json", timeout=30).json()
    for path, field in BODIES.items():
        body = document["paths"][path]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        assert field in schema["properties"], (path, schema)
        assert body["required"] is (path not in ("/rl/v1/sessions", "/rl/start_session"))
    messages = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert "$ref" not in str(messages), "every definition is inlined"
    assert messages["schema"]["properties"]["messages"]["items"]["properties"]["role"]["enum"]


@pytest.fixture
def fuzzed(proxies: ProxyFactory, scripted: ScriptedWorker) -> Proxy:
    """A proxy whose valid calls stay cheap: few tokens and choices however the fuzzer asks."""
    return proxies.start([scripted.url], default_max_tokens=8, context_length=256,
                         limits={"max_n": 4, "max_choices": 8, "max_top_logprobs": 4})


def test_no_request_gets_a_server_error(fuzzed: Proxy) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed.base_url}/openapi.json")
    failures: list[str] = []
    with_bodies: set[str] = set()
    with tapped_logs() as log:
        for key in (fuzzed.admin_key, fuzzed.session_key):
            for result in schema.get_all_operations():
                operation = result.ok()
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    strategy = operation.as_strategy(mode, headers={"Authorization": f"Bearer {key}"})
                    _fuzz(strategy, fuzzed.base_url, failures, with_bodies)
    assert not failures, f"{len(failures)} server errors:\n" + "\n".join(failures[:20])
    assert with_bodies >= set(BODIES), "every declared body was fuzzed"
    assert log.tracebacks() == []


def _fuzz(strategy: Any, base_url: str, failures: list[str], with_bodies: set[str]) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case: schemathesis.Case) -> None:
        if case.body is not NOT_SET:
            with_bodies.add(case.operation.path)
        response = case.call(base_url=base_url, timeout=60)
        if response.status_code >= 500:  # schemathesis's "not a server error" check; every one is reported
            failures.append(f"{case.operation.label} -> {response.status_code} {response.text[:300]}\n"
                            f"  {case.as_curl_command()}"[:2000])

    try:
        run()
    except Unsatisfiable:
        pass  # no invalid request exists for this operation (one without parameters or a body)
