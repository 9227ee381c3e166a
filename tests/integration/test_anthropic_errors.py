"""The Messages API's refusals, keys and token counting through the real proxy and the real `anthropic`
client: errors in Anthropic's shape with the statuses the SDK maps to its exceptions (the OpenAI routes
keep OpenAI's), `x-api-key` and `Authorization: Bearer` both accepted, and `count_tokens` counting the
prompt a call gets without generating or recording anything."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.anthropic_messages import SERVER_TOOL, TOOLS, client
from tests.support.proxy_harness import Proxy
from tests.support.scripted_worker import ScriptedWorker

HELLO = [{"role": "user", "content": "Hello there."}]
# Wire behaviour, not storage: SQLite only (test_anthropic_multiturn.py writes trajectories on both).
pytestmark = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def anthropic_error(exc: anthropic.APIStatusError) -> dict[str, Any]:
    body = exc.body
    assert isinstance(body, dict) and body["type"] == "error", body
    return dict(body["error"])


def test_a_bad_key_is_an_authentication_error_in_anthropics_shape(proxy: Proxy) -> None:
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client(proxy, "fw-sess-wrong").messages.create(model="m", max_tokens=8, messages=HELLO)  # type: ignore[arg-type]
    assert raised.value.status_code == 401
    assert anthropic_error(raised.value) == {"type": "authentication_error",
                                             "message": "Incorrect API key provided."}
    answer = httpx.post(f"{proxy.v1}/messages", json={"max_tokens": 8, "messages": HELLO})  # no key at all
    assert answer.status_code == 401 and answer.json()["error"]["type"] == "authentication_error"
    assert "x-request-id" in answer.headers

    with pytest.raises(openai.AuthenticationError) as openai_raised:  # the OpenAI routes keep their shape
        proxy.client("fw-sess-wrong").chat.completions.create(model="m", messages=HELLO)  # type: ignore[arg-type]
    assert openai_raised.value.body == {"message": "Incorrect API key provided.", "param": None,
                                        "type": "authentication_error", "code": "invalid_api_key"}


def test_x_api_key_and_bearer_both_work_on_every_route(proxy: Proxy) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": HELLO}
    for headers in ({"x-api-key": proxy.session_key}, {"Authorization": f"Bearer {proxy.session_key}"}):
        headers |= {"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-05-16"}  # ignored
        answer = httpx.post(f"{proxy.v1}/messages", json=body, headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-flywheel-session-id"] == proxy.session_id
        status = httpx.get(f"{proxy.base_url}/rl/v1/sessions/{proxy.session_id}", headers=headers)
        assert status.status_code == 200
        assert httpx.get(f"{proxy.v1}/models", headers=headers).status_code == 200
    sdk = anthropic.Anthropic(base_url=proxy.base_url, api_key=None, max_retries=0,
                              default_headers={"x-api-key": proxy.session_key})
    assert sdk.messages.create(model="m", max_tokens=8, messages=HELLO).id.startswith("msg_")  # type: ignore[arg-type]
    wrong = httpx.post(f"{proxy.v1}/messages", json=body, headers={"x-api-key": "fw-sess-wrong"})
    assert wrong.status_code == 401 and wrong.json()["type"] == "error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HELLO}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0]"),
        ({"max_tokens": 8, "messages": HELLO, "tool_choice": {"type": "tool", "name": "nope"},
          "tools": TOOLS}, "tool_choice.name"),
        ({"max_tokens": 8, "messages": HELLO, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ],
    ids=["no-max-tokens", "no-messages", "image", "unknown-tool", "no-input-schema"],
)
def test_an_invalid_request_is_a_bad_request_error_naming_the_field(
    proxy: Proxy, scripted: ScriptedWorker, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(proxy).post("/v1/messages", body={"model": "m", **body}, cast_to=httpx.Response)
    error = anthropic_error(raised.value)
    assert error["type"] == "invalid_request_error" and param in error["message"], error
    assert proxy.count_completions() == 0 and scripted.requests_to("/generate") == []


def test_a_missing_max_tokens_through_the_sdk_is_a_bad_request(proxy: Proxy) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(proxy).messages.create(model="m", messages=HELLO, max_tokens=anthropic.omit, timeout=30)  # type: ignore[arg-type]
    assert "max_tokens" in anthropic_error(raised.value)["message"]


def test_a_body_too_large_is_request_too_large(proxies: Any, scripted: ScriptedWorker) -> None:
    proxy = proxies.start([scripted.url], limits={"max_body_bytes": 1024})
    big = [{"role": "user", "content": "x" * 4096}]
    with pytest.raises(anthropic.APIStatusError) as raised:
        client(proxy).messages.create(model="m", max_tokens=8, messages=big)  # type: ignore[arg-type]
    assert raised.value.status_code == 413
    assert anthropic_error(raised.value)["type"] == "request_too_large"


def test_count_tokens_counts_the_calls_prompt_and_generates_nothing(
    proxy: Proxy, scripted: ScriptedWorker
) -> None:
    sdk = client(proxy)
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    kwargs: dict[str, Any] = {"model": "m", "messages": HELLO, "system": system}
    for recorded, tools in enumerate((None, [*TOOLS, SERVER_TOOL])):
        extra = {"tools": tools} if tools else {}
        counted = sdk.messages.count_tokens(**kwargs, **extra)
        assert len(scripted.requests_to("/generate")) == recorded == proxy.count_completions()
        message = sdk.messages.create(max_tokens=8, **kwargs, **extra)
        prompt_ids = proxy.completion(message.id).prompt_ids
        assert counted.input_tokens == message.usage.input_tokens == len(prompt_ids)
    with_tools = sdk.messages.count_tokens(**kwargs, tools=TOOLS).input_tokens
    assert with_tools > sdk.messages.count_tokens(**kwargs).input_tokens  # the tools are in the prompt
    with pytest.raises(anthropic.AuthenticationError):
        client(proxy, "fw-sess-wrong").messages.count_tokens(**kwargs)


@pytest.mark.parametrize("path", ["/v1/messages", "/messages", "/v1/messages/count_tokens",
                                  "/messages/count_tokens"])
def test_bad_bodies_are_refused_key_first_in_anthropics_shape(proxy: Proxy, path: str) -> None:
    url, key = f"{proxy.base_url}{path}", {"x-api-key": proxy.session_key}
    json_type = {"Content-Type": "application/json"}
    keyless = httpx.post(url, content=b"{not json", headers=json_type, timeout=10)
    assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "authentication_error"
    for content in (b"{not json", b"[1, 2]", b'{"messages": "hi", "max_tokens": -1}'):
        refused = httpx.post(url, content=content, headers={**key, **json_type}, timeout=10)
        assert refused.status_code == 400, refused.text
        assert refused.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                             "message": refused.json()["error"]["message"]}}
        assert len(refused.headers.get_list("x-request-id")) == 1  # an error answer names its request once
    assert httpx.get(url, headers=key, timeout=10).status_code == 405
    assert proxy.count_completions() == 0
