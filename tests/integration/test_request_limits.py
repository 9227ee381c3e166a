"""The limits of `proxy.limits` (proxy/config.py) on a real proxy over HTTP, on SQLite and Postgres. Each is
checked before the work it bounds: a bad key before the body is read, the body's size before it is
buffered, a prompt's length before it is tokenized, the numbers of a request before anything is
generated. Every refusal is a 4xx in OpenAI's shape naming what was wrong, and writes nothing."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.memory import peak_rss_growth
from tests.support.proxy_harness import Proxy, ProxyFactory
from tests.support.raw_http import send_body
from tests.support.refusals import refusal
from tests.support.scripted_worker import ScriptedWorker

HUGE = 100_000_000
"""A body no test holds: tests/support/raw_http.py streams it from one reused buffer."""
LIMIT = 8 << 20
JSON = {"Content-Type": "application/json"}
USER = [{"role": "user", "content": "hi"}]


def _post(proxy: Proxy, path: str, body: Any, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or proxy.session_key}", **JSON}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{proxy.base_url}{path}", content=content, headers=headers, timeout=60)


def test_a_huge_body_with_a_bad_key_is_refused_unread(proxy: Proxy) -> None:
    """The key is checked before the body is read: the 401 arrives while the body is still being sent,
    and the proxy's memory does not grow by it."""
    paths = ["/v1/chat/completions", "/v1/completions", "/responses", "/rl/v1/sessions",
             f"/rl/v1/sessions/{proxy.session_id}/reward", "/rl/set_reward"]
    for path in paths:
        for key in ({}, {"Authorization": "Bearer fw-sess-not-a-key"}):
            for chunked in (False, True):
                with peak_rss_growth() as growth:
                    answer = send_body(proxy.base_url, path, {**JSON, **key}, HUGE, chunked=chunked)
                assert refusal(answer, 401)["code"] == "invalid_api_key"
                assert answer.sent < HUGE, f"{path}: the whole body was read before the 401"
                assert growth.bytes < HUGE // 4, f"{path}: memory grew by {growth.bytes} bytes"
    assert proxy.count_completions() == 0


def test_a_body_over_the_limit_is_413_and_never_buffered(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    """With a key: 413 `request_too_large` from the Content-Length before reading, or, chunked, once the
    bytes read pass the limit; what was read is dropped, nothing beyond the limit is buffered."""
    proxy = proxies.start([scripted.url], limits={"max_body_bytes": LIMIT})
    sessions = len(proxy.sessions())
    targets = [("/v1/chat/completions", proxy.session_key), ("/v1/completions", proxy.admin_key),
               ("/v1/responses", proxy.session_key), ("/rl/v1/sessions", proxy.admin_key),
               (f"/rl/v1/sessions/{proxy.session_id}/reward", proxy.session_key)]
    for path, key in targets:
        for chunked in (False, True):
            headers = {**JSON, "Authorization": f"Bearer {key}"}
            with peak_rss_growth() as growth:
                answer = send_body(proxy.base_url, path, headers, HUGE, chunked=chunked)
            error = refusal(answer, 413)
            assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]
            assert answer.sent < HUGE
            assert growth.bytes < 4 * LIMIT, f"{path}: memory grew by {growth.bytes} bytes"
    at_limit = _post(proxy, "/v1/chat/completions", {"model": "m", "messages": USER, "max_tokens": 1,
                                                     "user": "x" * (LIMIT - 200)})
    assert at_limit.status_code == 200, at_limit.text
    assert proxy.count_completions() == 1 and len(proxy.sessions()) == sessions


def test_a_prompt_over_max_prompt_chars_is_400_naming_it(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    """Counted in characters before tokenization, over every message, prompt or input item."""
    proxy = proxies.start([scripted.url], limits={"max_prompt_chars": 1000}, context_length=100_000)
    half = "word " * 120  # 600 characters
    too_long = [
        ("/v1/chat/completions", {"messages": [
            {"role": "system", "content": half}, {"role": "user", "content": [{"type": "text", "text": half}]}
        ]}, "messages"),
        ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": half}}]},
            {"role": "tool", "tool_call_id": "c", "content": half}]}, "messages"),
        ("/v1/completions", {"prompt": [half, half]}, "prompt"),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": half}]}],
                           "instructions": half}, "input"),
    ]
    for path, body, param in too_long:
        error = refusal(_post(proxy, path, {"model": "m", "max_tokens": 1, **body}), 400)
        assert (error["param"], error["code"]) == (param, "prompt_too_long")
        assert "1000" in error["message"]
    assert proxy.count_completions() == 0
    fits = _post(proxy, "/v1/completions", {"model": "m", "prompt": ["a" * 500, "b" * 500], "max_tokens": 1})
    assert fits.status_code == 200, fits.text


def test_call_caps_are_400s_naming_the_field(proxies: ProxyFactory, scripted: ScriptedWorker) -> None:
    proxy = proxies.start([scripted.url], limits={"max_n": 4, "max_prompts": 3, "max_choices": 6,
                                                  "max_top_logprobs": 2})
    refused = [
        ("/v1/chat/completions", {"messages": USER, "n": 5}, "n", "integer_above_max_value"),
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", "array_above_max_length"),
        ("/v1/completions", {"prompt": [[1, 2], [3], [4]], "n": 3}, "n", "too_many_choices"),
        ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 3}, "top_logprobs",
         "integer_above_max_value"),
        ("/v1/completions", {"prompt": "a", "logprobs": 3}, "logprobs", "integer_above_max_value"),
        ("/v1/responses", {"input": "a", "top_logprobs": 3}, "top_logprobs", "integer_above_max_value"),
    ]
    for path, body, param, code in refused:
        error = refusal(_post(proxy, path, {"model": "m", "max_tokens": 1, **body}), 400)
        assert (error["param"], error["code"]) == (param, code), (body, error)
    assert proxy.count_completions() == 0
    at_caps = [("/v1/chat/completions", {"messages": USER, "n": 4, "logprobs": True, "top_logprobs": 2}),
               ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "logprobs": 2})]
    for path, body in at_caps:
        answer = _post(proxy, path, {"model": "m", "max_tokens": 1, **body})
        assert answer.status_code == 200, answer.text
    assert proxy.count_completions() == 4 + 6


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_k", 2**70), ("top_k", 2**31), ("top_k", 0), ("seed", 2**64), ("seed", -(2**70)),
     ("max_tokens", 2**70), ("max_completion_tokens", 2**31), ("repetition_penalty", 3.0),
     ("logit_bias", {"not-a-token": 1.0}), ("logit_bias", {"5": 1e6}), ("logit_bias", {"99999999": 1.0})],
)
def test_numbers_beyond_what_workers_and_storage_take_are_400(proxy: Proxy, field: str, value: Any) -> None:
    """Bounded at validation (a 32-bit `top_k` column, SGLang's 64-bit seed, the vocabulary), never
    generated and then failing to record."""
    for path, body in [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "hi"})]:
        if field == "max_completion_tokens" and path == "/v1/completions":
            continue
        error = refusal(_post(proxy, path, {"model": "m", "max_tokens": 1, **body, field: value}), 400)
        assert error["param"] is not None and error["param"].startswith(field), error
        assert error["type"] == "invalid_request_error"
    assert proxy.count_completions() == 0


def test_json_nested_too_deeply_is_400(proxy: Proxy) -> None:
    deep_metadata = {"model": "m", "messages": USER, "max_tokens": 1, "metadata": {"a": _nested(70)}}
    for path, body in [("/v1/chat/completions", json.dumps(deep_metadata).encode()),
                       ("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000),
                       ("/rl/v1/sessions", json.dumps({"task": _nested(70)}).encode()),
                       ("/rl/v1/sessions", b"[" * 100_000 + b"]" * 100_000)]:
        assert refusal(_post(proxy, path, body, proxy.admin_key), 400)["code"] == "json_too_deep"
    shallow = {**deep_metadata, "metadata": {"a": _nested(60)}}
    assert _post(proxy, "/v1/chat/completions", shallow).status_code == 200


def test_rl_free_form_fields_are_bounded_and_must_be_json(proxy: Proxy) -> None:
    """`task`, `metadata`, reward `details` (and AReaL's `task_id`) past `max_rl_json_bytes` are a 413
    naming the field; NaN or an infinity inside them (JSON has neither) a 422."""
    sessions = len(proxy.sessions())
    big = "x" * (256 * 1024)
    reward = f"/rl/v1/sessions/{proxy.session_id}/reward"
    oversized = [("/rl/v1/sessions", {"task": big}, "task"),
                 ("/rl/v1/sessions", {"metadata": {"k": big}}, "metadata"),
                 ("/rl/v1/groups", {"size": 2, "task": [big]}, "task"),
                 ("/rl/start_session", {"task_id": big}, "task_id"),
                 (reward, {"value": 1.0, "details": {"why": big}}, "details")]
    for path, body, param in oversized:
        error = refusal(_post(proxy, path, body, proxy.admin_key), 413)
        assert (error["param"], error["code"]) == (param, "request_too_large")
    for path, raw, param in [("/rl/v1/sessions", b'{"task": NaN}', "task"),
                             ("/rl/v1/sessions", b'{"metadata": {"k": [Infinity]}}', "metadata"),
                             (reward, b'{"value": 1, "details": {"k": -Infinity}}', "details"),
                             ("/rl/v1/sessions", b'{"task": 1e999}', "task")]:
        error = refusal(_post(proxy, path, raw, proxy.admin_key), 422)
        assert error["param"] == param
    assert len(proxy.sessions()) == sessions
    fits = _post(proxy, "/rl/v1/sessions", {"task": "x" * 1000, "metadata": {"k": "v"}}, proxy.admin_key)
    assert fits.status_code == 201, fits.text


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value
