"""The proxy in front of a scripted SGLang worker, on SQLite and Postgres, driven by the real `openai`
client over HTTP: answers in OpenAI's shape, and every completion a client received is recorded
token-exactly (ids, logprobs, per-token policy versions)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory, dead_worker_url, run_db
from tests.support.recorded import assert_recorded, scripted_text
from tests.support.scripted_worker import ScriptedWorker, default_token_fn

MESSAGES = [
    {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
    {"role": "user", "content": "What is 2 + 2?"},
]


def test_non_stream_n2_logprobs_are_recorded(
    proxy: Proxy, scripted: ScriptedWorker, tiny_model_dir: Any
) -> None:
    client = proxy.client()
    response = client.chat.completions.create(
        model="anything", messages=MESSAGES, max_tokens=7, n=2, logprobs=True, seed=5, temperature=0.7,
    )
    assert response.object == "chat.completion"
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage is not None and response.usage.completion_tokens == 14
    assert response.choices[0].message.content != response.choices[1].message.content
    ids = [c.model_extra["completion_id"] for c in response.choices]  # type: ignore[index]
    assert ids[0] == response.id and ids[1] != ids[0]
    rows = [assert_recorded(proxy, cid, c.message.content or "")
            for cid, c in zip(ids, response.choices, strict=True)]
    for row, choice in zip(rows, response.choices, strict=True):
        assert choice.finish_reason == row.finish_reason == "length"
        assert choice.logprobs is not None and choice.logprobs.content is not None
        served = [e.logprob for e in choice.logprobs.content]
        assert served == pytest.approx(row.output_logprobs.tolist(), abs=1e-6)
        assert row.output_versions.tolist() == [0] * 7
        assert row.temperature == pytest.approx(0.7) and row.top_p == 1.0 and row.top_k == -1
        assert row.request_json["messages"] == MESSAGES
        assert row.response_json["choices"][0]["index"] == choice.index
    # Token-exact prompt: the chat template rendered once, sent as input_ids.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    flat = [{"role": "system", "content": "You are terse."}, MESSAGES[1]]
    expected_prompt = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(rows[0].prompt_ids.tolist()) == expected_prompt
    (sent,) = scripted.requests_to("/generate")
    assert sent.body["input_ids"] == rows[0].prompt_ids.tolist() == rows[1].prompt_ids.tolist()
    assert sent.body["return_logprob"] is True and sent.body["rid"] == response.id
    assert sent.body["sampling_params"] == {
        "max_new_tokens": 7, "temperature": 0.7, "top_p": 1.0, "n": 2, "sampling_seed": 5,
    }


def test_stream_with_usage_is_recorded(proxy: Proxy, scripted: ScriptedWorker) -> None:
    stream = proxy.client().chat.completions.create(
        model="m", messages=MESSAGES, max_completion_tokens=9, stream=True,
        stream_options={"include_usage": True}, logprobs=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    logprobs = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or ()]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    row = assert_recorded(proxy, chunks[0].id, content)
    assert len(row.output_ids) == 9 and logprobs == pytest.approx(row.output_logprobs.tolist(), abs=1e-6)
    assert scripted.requests_to("/generate")[0].body["stream"] is True


def test_stream_without_usage_ends_with_finish_reason(proxy: Proxy) -> None:
    headers = {"Authorization": f"Bearer {proxy.session_key}", "x-request-id": "trace-42"}
    with httpx.stream(
        "POST", f"{proxy.v1}/chat/completions", headers=headers,
        json={"model": "m", "messages": MESSAGES, "max_tokens": 3, "stream": True}, timeout=30,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"] == "trace-42"  # the client's id, for tracing
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2] and '"usage"' not in events[-2]


async def test_async_client_stream_and_non_stream(proxy: Proxy) -> None:
    client = proxy.async_client()
    response = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert_recorded(proxy, response.id, response.choices[0].message.content or "")
    stream = await client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert_recorded(proxy, chunks[0].id, content)
    await client.close()


def test_stop_string_never_leaks_into_the_stream(proxy: Proxy) -> None:
    client = proxy.client()
    answer = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12)
    plain = answer.choices[0].message.content
    assert plain and len(plain) == 12
    stop = plain[5:8]
    expected = plain[: plain.index(stop)]
    stream = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=12, stop=[stop], stream=True
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    assert proxy.completion(chunks[0].id).finish_reason == "stop"


def test_policy_versions_are_per_token(proxy: Proxy, scripted: ScriptedWorker) -> None:
    scripted.token_delay_s = 0.02
    stream = proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=12, stream=True)
    seen = 0
    for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 4:
            scripted.weight_version = "3"  # the trainer pushed version 3 mid-generation
    row = proxy.completion(chunk.id)
    versions = row.output_versions.tolist()
    assert versions[0] == 0 and versions[-1] == 3 and versions == sorted(versions)


def test_dropped_stream_records_partial_abort(proxy: Proxy, scripted: ScriptedWorker) -> None:
    scripted.token_delay_s = 0.02
    stream = proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=500, stream=True)
    received = ""
    for chunk in stream:
        received += chunk.choices[0].delta.content or ""
        if len(received) >= 3:
            break
    stream.close()  # the client hangs up
    row = None
    deadline = time.monotonic() + 20
    while row is None and time.monotonic() < deadline:
        row = next((c for c in proxy.completions() if c.id == chunk.id), None)
        time.sleep(0.05)
    assert row is not None, "the dropped stream was not recorded"
    assert row.finish_reason == "abort"
    assert 3 <= len(row.output_ids) < 500
    assert scripted_text(row.output_ids).startswith(received)
    assert len(row.output_logprobs) == len(row.output_versions) == len(row.output_ids)
    deadline = time.monotonic() + 10
    while scripted.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert scripted.in_flight == 0, "the worker kept generating for a client that left"


def test_bad_key_and_ended_session_key_are_401(proxy: Proxy) -> None:
    with pytest.raises(openai.AuthenticationError) as bad:
        proxy.client(key="fw-sess-not-a-key").chat.completions.create(model="m", messages=MESSAGES)
    assert bad.value.status_code == 401 and bad.value.code == "invalid_api_key"
    assert bad.value.body["type"] == "authentication_error"  # type: ignore[index]
    response = httpx.get(f"{proxy.v1}/models", timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"

    from storage.queries import end_session

    run_db(proxy.db_url, lambda factory: end_session(factory, proxy.session_id))
    with pytest.raises(openai.AuthenticationError) as ended:
        proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert ended.value.code == "invalid_api_key" and "ended" in ended.value.message
    assert proxy.count_completions() == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": "hello"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "pirate", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": MESSAGES, "n": 0}, "n"),
        ({"model": "m", "messages": MESSAGES, "temperature": -1}, "temperature"),
        ({"model": "m", "messages": MESSAGES, "max_tokens": "many"}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "messages[0].content[0]"),
    ],
)
def test_bad_bodies_are_400_and_write_nothing(proxy: Proxy, body: dict[str, Any], param: str) -> None:
    sessions_before = len(proxy.sessions())
    client = proxy.client(key=proxy.admin_key)  # an admin call would create a session: it must not
    with pytest.raises(openai.BadRequestError) as error:
        client.post("/chat/completions", body=body, cast_to=object)
    assert error.value.status_code == 400
    assert error.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert error.value.param == param
    assert proxy.count_completions() == 0 and len(proxy.sessions()) == sessions_before


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/responses"])
def test_bad_requests_are_refused_key_first(proxy: Proxy, path: str) -> None:
    """The inference routes take their raw request (proxy/hot_routes.py) and check the key before they
    read the body: a bad key first, then unparsable JSON, then the body's fields."""
    url, key = f"{proxy.base_url}{path}", {"Authorization": f"Bearer {proxy.session_key}"}
    json_type = {"Content-Type": "application/json"}
    unparsable = httpx.post(url, content=b"{not json", timeout=10, headers={**key, **json_type})
    assert unparsable.status_code == 400 and unparsable.json()["error"]["type"] == "invalid_request_error"
    assert len(unparsable.headers.get_list("x-request-id")) == 1  # an error answer names its request once
    keyless = httpx.post(url, content=b"{not json", timeout=10, headers=json_type)
    assert keyless.status_code == 401  # the key is looked at before the body is read
    assert len(keyless.headers.get_list("x-request-id")) == 1
    assert httpx.post(url, json={"max_tokens": "many"}, timeout=10).status_code == 401
    fields = {"max_tokens": "many", "max_output_tokens": "many"}
    invalid = httpx.post(url, json=fields, headers=key, timeout=10)
    assert invalid.status_code == 400 and invalid.json()["error"]["type"] == "invalid_request_error"
    not_object = httpx.post(url, json=[1, 2], headers=key, timeout=10)
    assert not_object.status_code == 400
    assert proxy.count_completions() == 0


def test_unknown_fields_and_agent_extras_are_accepted(proxy: Proxy) -> None:
    response = proxy.client().chat.completions.create(
        model="m",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Read a.txt"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "file body"}]},
        ],
        tools=[{"type": "function", "function": {"name": "read", "strict": True, "parameters": {
            "type": "object", "properties": {"p": {"type": "integer"}}, "additionalProperties": False}}}],
        tool_choice="required", parallel_tool_calls=True, user="u1", metadata={"k": "v"},
        response_format={"type": "text"}, stop="Observation:", max_tokens=3,
        extra_body={"brand_new_openai_field": {"x": 1}, "top_k": 20},
    )
    row = assert_recorded(proxy, response.id, response.choices[0].message.content or "")
    assert row.top_k == 20


def test_context_length_exceeded_is_400(proxies: ProxyFactory, scripted: ScriptedWorker) -> None:
    small = proxies.start([scripted.url], context_length=16)
    with pytest.raises(openai.BadRequestError) as error:
        small.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "word " * 40}]
        )
    assert error.value.code == "context_length_exceeded"
    clamped = small.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=1000)
    assert clamped.choices[0].finish_reason == "length"
    assert 0 < (clamped.usage.total_tokens if clamped.usage else 0) <= 16


def test_default_max_tokens_applies_without_a_limit(proxies: ProxyFactory, scripted: ScriptedWorker) -> None:
    proxy = proxies.start([scripted.url], default_max_tokens=6)
    response = proxy.client().chat.completions.create(model="m", messages=MESSAGES)
    assert response.usage is not None and response.usage.completion_tokens == 6
    assert scripted.requests_to("/generate")[-1].body["sampling_params"]["max_new_tokens"] == 6


def test_worker_down_is_503_in_openai_shape(proxies: ProxyFactory) -> None:
    proxy = proxies.start([dead_worker_url()])
    with pytest.raises(openai.InternalServerError) as error:
        proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert error.value.status_code == 503 and error.value.code == "worker_unavailable"
    assert error.value.response.headers["x-request-id"]
    assert error.value.response.headers["retry-after"] == "1"  # workers come back: retry soon
    with pytest.raises(openai.InternalServerError):
        proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, stream=True)
    assert proxy.count_completions() == 0


def test_failover_and_balancing_across_workers(proxies: ProxyFactory, servers: LoopThread) -> None:
    first, second = servers.start_scripted(), servers.start_scripted()
    proxy = proxies.start([dead_worker_url(), first.url, second.url])
    client = proxy.client(key=proxy.admin_key)  # a new session per call: balanced, not sticky
    for _ in range(3):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, stream=True))
    assert len(first.requests_to("/generate")) == 3 and len(second.requests_to("/generate")) == 3
    assert proxy.count_completions() == 6
    for worker in (first, second):
        servers.call(worker.stop())


def test_worker_400_reaches_the_client(proxies: ProxyFactory, servers: LoopThread) -> None:
    worker = servers.start_scripted()
    original = worker._parse_generate

    def reject(body: Any) -> Any:
        from tests.support import scripted_worker

        raise scripted_worker._BadRequest({"message": "sampling_seed out of range"})

    worker._parse_generate = reject  # type: ignore[method-assign]
    proxy = proxies.start([worker.url])
    with pytest.raises(openai.BadRequestError) as error:
        proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert "sampling_seed out of range" in error.value.message
    worker._parse_generate = original  # type: ignore[method-assign]
    servers.call(worker.stop())
    assert proxy.count_completions() == 0


def test_bad_weight_version_is_502_not_a_wrong_record(proxy: Proxy, scripted: ScriptedWorker) -> None:
    scripted.weight_version = "v-latest"
    with pytest.raises(openai.InternalServerError) as error:
        proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert error.value.status_code == 502
    assert proxy.count_completions() == 0


def test_admin_call_gets_its_own_ended_session(proxy: Proxy) -> None:
    raw = proxy.client(key=proxy.admin_key).chat.completions.with_raw_response.create(
        model="m", messages=MESSAGES, max_tokens=2
    )
    session_id = raw.headers["x-flywheel-session-id"]
    response = raw.parse()
    assert_recorded(proxy, response.id, response.choices[0].message.content or "", session_id=session_id)
    session = next(s for s in proxy.sessions() if s.id == session_id)
    assert session.status == "ended"
    assert session.metadata_ == {"origin": "admin-call", "missing_reward": "drop"}


def test_root_chat_route_models_and_metrics(proxy: Proxy) -> None:
    headers = {"Authorization": f"Bearer {proxy.session_key}"}
    root = httpx.post(f"{proxy.base_url}/chat/completions", headers=headers, timeout=10,
                      json={"messages": MESSAGES, "max_tokens": 2})
    assert root.status_code == 200 and root.json()["object"] == "chat.completion"
    client = proxy.client()
    served = client.models.list().data
    assert len(served) == 1
    assert client.models.retrieve(served[0].id).id == served[0].id
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-5")
    assert missing.value.code == "model_not_found"
    unknown = httpx.post(f"{proxy.v1}/nothing-here", headers=headers, timeout=10)
    assert unknown.status_code == 404 and unknown.json()["error"]["message"].startswith("Invalid URL")
    # POSTs to the chat paths skip FastAPI's stack (proxy/hot_routes.py); other methods still get its 405.
    wrong_method = httpx.get(f"{proxy.v1}/chat/completions", headers=headers, timeout=10)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert wrong_method.headers["x-request-id"]
    metrics = httpx.get(f"{proxy.base_url}/metrics", timeout=10).text
    assert 'flywheel_proxy_requests_total{route="/chat/completions",status="200"} 1.0' in metrics
    assert 'flywheel_proxy_requests_total{route="/v1/chat/completions",status="405"} 1.0' in metrics
    assert "flywheel_proxy_record_batch_size_count 1.0" in metrics
    assert 'flywheel_proxy_tokens_total{kind="completion"} 2.0' in metrics


def test_cached_key_stops_working_when_its_session_ends(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    from storage.queries import end_session

    exact = proxies.start([scripted.url], key_cache_ttl_s=0)
    exact.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    run_db(exact.db_url, lambda factory: end_session(factory, exact.session_id))  # another process ends it
    with pytest.raises(openai.AuthenticationError):
        exact.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)

    cached = proxies.start([scripted.url], key_cache_ttl_s=3600)
    cached.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)  # now cached
    ended = httpx.post(f"{cached.base_url}/rl/v1/sessions/{cached.session_id}/end", timeout=10,
                       headers={"Authorization": f"Bearer {cached.session_key}"})
    assert ended.status_code == 200, ended.text
    with pytest.raises(openai.AuthenticationError):
        cached.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)


def test_worker_failing_mid_stream_sends_an_error_event_and_records_the_partial(
    proxies: ProxyFactory, servers: LoopThread
) -> None:
    def fail_at_fourth_token(prompt_ids: Any, position: int, index: int, seed: int) -> int:
        if position == 3:
            raise RuntimeError("worker crashed")
        return default_token_fn(prompt_ids, position, index, seed)

    worker = servers.start_scripted(token_fn=fail_at_fourth_token)
    proxy = proxies.start([worker.url])
    stream = proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=20, stream=True)
    received, response_id = "", ""
    with pytest.raises(openai.APIError):
        for chunk in stream:
            response_id = chunk.id
            received += chunk.choices[0].delta.content or ""
    row = proxy.completion(response_id)
    assert row.finish_reason == "abort" and scripted_text(row.output_ids) == received
    assert len(row.output_ids) == 3
    servers.call(worker.stop())
