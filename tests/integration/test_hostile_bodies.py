"""Nothing a client sends makes the proxy fail: a corpus of hostile bodies (tests/support/hostile.py:
invalid UTF-8, deep nesting, lone surrogates and NULs in every string, huge and non-finite numbers, wrong
types, empty and non-JSON bodies, enormous strings) sent to every POST route that reads a body, the
OpenAI surface and the RL API alike, with a valid (admin) key, on SQLite and Postgres. Every answer is
a 4xx in OpenAI's shape (Ollama's `/api/show` probe answers in Ollama's), nothing is written, and the
server's log holds no traceback."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.hostile import HostileBody, hostile_bodies
from tests.support.log_tap import tapped_logs
from tests.support.proxy_harness import Proxy
from tests.support.refusals import refusal

LONG = "x" * 5_000_000
"""Within the 32 MiB body limit, beyond every bound on a field's length or a prompt's characters."""
AREAL_KEY = "fw-sess-8f3Kq2LmZx7Rt4Vw9Yb1Nc6Hd0Jg5Ps"  # a key AReaL's client may choose for a session
CHAT = {"model": "m", "max_tokens": 1,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "temperature": 0.5, "top_p": 0.9, "n": 1, "seed": 3, "top_k": 4, "min_p": 0.1,
        "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1,
        "logit_bias": {"7": 1.5}, "stop": ["STOP"], "user": "u", "metadata": {"k": "v"}, "logprobs": True,
        "top_logprobs": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 1, "temperature": 0.5, "n": 1, "seed": 3,
              "top_k": 4, "logit_bias": {"7": 1.5}, "logprobs": 2, "stop": "STOP", "user": "u"}
RESPONSE = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
            "instructions": "Be brief.", "max_output_tokens": 1, "temperature": 0.5, "top_p": 0.9,
            "top_logprobs": 2, "metadata": {"k": "v"}, "user": "u", "top_k": 4, "seed": 3}


@dataclass(frozen=True)
class Route:
    path: str
    base: dict[str, Any]
    """A valid body."""
    any_json: frozenset[str] = frozenset()
    any_number: frozenset[str] = frozenset()
    finite_range: frozenset[str] = frozenset()
    enormous: tuple[tuple[str | int, ...], Any] | None = None
    empty_is_valid: bool = False
    ollama: bool = False


def _routes(session_id: str, completion_id: str) -> list[Route]:
    chat = [Route(path, CHAT, enormous=(("messages", 1, "content"), LONG))
            for path in ("/v1/chat/completions", "/chat/completions")]
    legacy = [Route(path, COMPLETION, enormous=(("prompt",), LONG))
              for path in ("/v1/completions", "/completions")]
    responses = [Route(path, RESPONSE, enormous=(("instructions",), LONG))
                 for path in ("/v1/responses", "/responses")]
    reward = {"value": 0.5, "source": "judge", "details": {"why": "ok", "score": 3}}
    finite, free = frozenset({"value", "reward"}), frozenset({"n", "score"})
    return [*chat, *legacy, *responses,
            Route("/rl/v1/sessions", {"task": {"prompt": "p", "n": 1}, "metadata": {"k": "v"}},
                  any_json=frozenset({"task"}), any_number=free, enormous=(("task", "prompt"), LONG),
                  empty_is_valid=True),
            Route("/rl/v1/groups", {"size": 2, "task": "t"}, any_json=frozenset({"task"}),
                  enormous=(("task",), LONG)),
            Route(f"/rl/v1/sessions/{session_id}/reward", reward, any_number=free,
                  finite_range=finite, enormous=(("source",), LONG)),
            Route(f"/rl/v1/completions/{completion_id}/reward", reward, any_number=free,
                  finite_range=finite, enormous=(("details", "why"), LONG)),
            Route("/rl/start_session", {"task_id": "t", "api_key": AREAL_KEY, "group_size": 2},
                  any_json=frozenset({"task_id"}), enormous=(("task_id",), LONG), empty_is_valid=True),
            Route("/rl/set_reward", {"reward": 1.0, "interaction_id": completion_id},
                  finite_range=finite, enormous=(("interaction_id",), LONG)),
            Route("/api/show", {"model": "m"}, enormous=(("model",), LONG), ollama=True)]


def _send(proxy: Proxy, route: Route, body: HostileBody, client: httpx.Client) -> httpx.Response:
    """With an admin key: it may call every route, and no rate limit holds it back, so every body
    reaches the checks of what it holds."""
    headers = {"Authorization": f"Bearer {proxy.admin_key}", "Content-Type": body.content_type}
    return client.post(f"{proxy.base_url}{route.path}", content=body.content, headers=headers)


def test_every_hostile_body_is_a_4xx_in_openais_shape(proxy: Proxy) -> None:
    first = proxy.client().chat.completions.create(model="m", messages=CHAT["messages"], max_tokens=1)
    routes = _routes(proxy.session_id, first.id)
    before = (proxy.count_completions(), len(proxy.sessions()))
    failures: list[str] = []
    sent = 0
    with tapped_logs() as log, httpx.Client(timeout=120) as client:
        for route in routes:
            bodies = hostile_bodies(route.base, any_json=route.any_json, any_number=route.any_number,
                                    finite_range=route.finite_range, enormous=route.enormous,
                                    empty_is_valid=route.empty_is_valid)
            for body in bodies:
                sent += 1
                answer = _send(proxy, route, body, client)
                try:
                    _assert_refused(answer, route.ollama)
                except AssertionError as exc:
                    failures.append(f"{route.path} <- {body.name}: {exc}")
    assert not failures, f"{len(failures)} of {sent} hostile bodies were not refused cleanly:\n" + "\n".join(
        failure[:400] for failure in failures[:40])
    assert (proxy.count_completions(), len(proxy.sessions())) == before
    assert log.tracebacks() == []
    assert log.at_least(40) == []  # logging.ERROR: no failure was logged either


def _assert_refused(answer: httpx.Response, ollama: bool) -> None:
    assert answer.status_code != 429, "rate-limited: the body was never looked at"
    if not ollama:
        refusal(answer)
        return
    assert 400 <= answer.status_code < 500, f"HTTP {answer.status_code}: {answer.text[:300]}"
    assert isinstance(answer.json()["error"], str)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_an_empty_body_is_named_as_missing(proxy: Proxy, path: str) -> None:
    headers = {"Authorization": f"Bearer {proxy.session_key}", "Content-Type": "application/json"}
    error = refusal(httpx.post(f"{proxy.base_url}{path}", content=b"", headers=headers, timeout=30), 400)
    assert error["code"] == "missing_required_parameter"
    assert "request body" in error["message"] and "None" not in error["message"]


def test_a_nul_in_a_path_is_an_unknown_url(proxy: Proxy) -> None:
    """A `%00` in a path parameter would reach a query Postgres cannot run: it names nothing."""
    headers = {"Authorization": f"Bearer {proxy.admin_key}"}
    requests = [("GET", f"/rl/v1/sessions/{proxy.session_id}%00"), ("GET", "/v1/responses/resp_%00"),
                ("POST", f"/rl/v1/sessions/{proxy.session_id}%00/end"),
                ("POST", "/rl/v1/completions/a%00/reward"), ("POST", "/v1/chat/completions%00")]
    with tapped_logs() as log:
        for method, path in requests:
            answer = httpx.request(method, f"{proxy.base_url}{path}", headers=headers, json={"value": 1},
                                   timeout=30)
            assert refusal(answer, 404)["code"] == "unknown_url", path
    assert log.tracebacks() == []
    assert [s.status for s in proxy.sessions() if s.id == proxy.session_id] == ["active"]
