"""The Responses API streamed: named SSE events in order, items that open and close as the parser finds
them (text, reasoning, function calls), logprobs, the same result as not streamed, and a dropped stream
recorded as an abort. The scripted replies and the readers are tests/support/responses_api.py's."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.support.proxy_harness import Proxy, ProxyFactory
from tests.support.responses_api import (
    CHAT_TOOLS,
    GREETING,
    QUESTION,
    THINKING,
    TOOLS,
    assert_response_recorded,
    collect_stream,
    function_calls,
    rendered,
)
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript


def test_streaming_sends_the_named_event_sequence(proxy: Proxy, script: TextScript) -> None:
    client = proxy.client()
    whole = client.responses.create(model="m", input="Say hello")
    with client.responses.create(model="m", input="Say hello", stream=True) as stream:
        events, final = collect_stream(stream)
    names = [e.type for e in events]
    assert names[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == GREETING == final.output_text == whole.output_text
    item_id = events[2].item.id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item_id}
    assert final.status == "completed" and final.output[0].id == item_id
    assert final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]
    prompt_ids = rendered(script, [{"role": "user", "content": "Say hello"}])
    row = assert_response_recorded(proxy, script, final.id, prompt_ids)
    assert row.response_json == final.model_dump(mode="json", exclude_unset=True)


def test_raw_stream_is_named_server_sent_events(proxy: Proxy) -> None:
    body = {"model": "m", "input": "Say hello", "stream": True}
    headers = {"Authorization": f"Bearer {proxy.session_key}"}
    with httpx.stream("POST", f"{proxy.v1}/responses", json=body, headers=headers, timeout=30) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        blocks = answer.read().decode().strip().split("\n\n")
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        assert json.loads(data_line[len("data: "):])["type"] == event_line[len("event: "):]
    assert blocks[-1].startswith("event: response.completed")
    root = httpx.post(f"{proxy.base_url}/responses", json={**body, "stream": False}, headers=headers,
                      timeout=30)
    assert root.status_code == 200 and root.json()["output"][0]["content"][0]["text"] == GREETING
    admin = httpx.post(f"{proxy.v1}/responses", json={"input": "Say hello"}, timeout=30,
                       headers={"Authorization": f"Bearer {proxy.admin_key}"})
    session_id = admin.headers["x-flywheel-session-id"]  # an admin call gets its own one-off session
    assert proxy.completion(admin.json()["id"]).session_id == session_id
    assert next(s for s in proxy.sessions() if s.id == session_id).status == "ended"


def test_streamed_and_non_streamed_function_calls_agree(proxy: Proxy, script: TextScript) -> None:
    client = proxy.client()
    whole = client.responses.create(model="m", input=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
    with client.responses.create(model="m", input=QUESTION, tools=TOOLS, stream=True) as stream:  # type: ignore[arg-type]
        events, final = collect_stream(stream)
    names = [e.type for e in events]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    added, done = events[2].item, events[5].item
    assert added.type == "function_call" and added.arguments == "" and added.status == "in_progress"
    streamed = (done.name, json.loads(done.arguments))
    expected = [(c.name, json.loads(c.arguments)) for c in function_calls(whole)]
    assert [streamed] == expected == [("get_weather", {"city": "Paris"})]
    assert events[4].arguments == done.arguments == function_calls(whole)[0].arguments
    assert function_calls(final)[0].call_id == done.call_id
    prompt_ids = rendered(script, [{"role": "user", "content": QUESTION}], CHAT_TOOLS)
    assert_response_recorded(proxy, script, whole.id, prompt_ids)
    assert_response_recorded(proxy, script, final.id, prompt_ids)


def test_dropped_stream_is_recorded_as_abort(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    worker.token_delay_s = 0.02
    received, response_id = "", ""
    with proxy.client().responses.create(model="m", input="Tell a story", stream=True) as stream:
        for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            received += getattr(event, "delta", "") if event.type == "response.output_text.delta" else ""
            if len(received) >= 10:
                break
    row = None
    deadline = time.monotonic() + 20
    while row is None and time.monotonic() < deadline:
        row = next((c for c in proxy.completions() if c.id == response_id), None)
        time.sleep(0.05)
    assert row is not None, "the dropped stream was not recorded"
    assert row.finish_reason == "abort" and row.response_json["status"] == "cancelled"
    assert 0 < len(row.output_ids) < len(script.output_ids(list(row.prompt_ids)))
    assert list(row.output_ids) == script.output_ids(list(row.prompt_ids))[:len(row.output_ids)]


def test_reasoning_becomes_a_reasoning_item_streamed_and_not(
    proxies: ProxyFactory, worker: ScriptedWorker, script: TextScript
) -> None:
    proxy = proxies.start([worker.url], reasoning_parser="qwen3")
    client = proxy.client()
    whole = client.responses.create(model="m", input="Think first, then greet")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0]
    assert reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content or []] == ["The user wants a greeting."]  # type: ignore[union-attr]
    assert whole.output_text == GREETING
    assert whole.usage is not None and 0 < whole.usage.output_tokens_details.reasoning_tokens
    with client.responses.create(model="m", input="Think first, then greet", stream=True) as stream:
        events, final = collect_stream(stream)
    names = [e.type for e in events]
    assert names[2:5] == ["response.output_item.added", "response.content_part.added",
                          "response.reasoning_text.delta"]
    assert "response.reasoning_text.done" in names and names[-1] == "response.completed"
    reasoned = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoned == "The user wants a greeting."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == GREETING
    row = proxy.completion(whole.id)  # the record keeps the raw tokens, <think> block included
    assert script.tokenizer.decode(list(row.output_ids[:-1])) == THINKING + GREETING

    # The next turn re-sends the reasoning item with the message: it still continues this turn.
    items = [{"role": "user", "content": "Think first, then greet"},
             *(item.model_dump(exclude_none=True) for item in whole.output),
             {"role": "user", "content": "Say hello"}]
    follow = client.responses.create(model="m", input=items)  # type: ignore[arg-type]
    assert proxy.completion(follow.id).parent_id == final.id  # the latest of the two equal turns


def test_text_then_a_call_streams_a_message_item_closed_before_the_call(proxy: Proxy) -> None:
    client = proxy.client()
    question = "What is it like in Oslo?"
    whole = client.responses.create(model="m", input=question, tools=TOOLS)  # type: ignore[arg-type]
    with client.responses.create(model="m", input=question, tools=TOOLS, stream=True) as stream:  # type: ignore[arg-type]
        events, final = collect_stream(stream)
    names = [e.type for e in events]
    message_done = names.index("response.output_item.done")
    assert names[message_done - 2:message_done] == ["response.output_text.done", "response.content_part.done"]
    assert names[message_done + 1:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]

    def shape(response: Any) -> list[tuple[str, str]]:
        return [(item.type, item.content[0].text if item.type == "message" else item.arguments)
                for item in response.output]

    assert shape(final) == shape(whole) == [("message", "Let me check."),
                                            ("function_call", '{"city": "Oslo"}')]


def test_output_text_logprobs_streamed_and_not(proxy: Proxy, script: TextScript) -> None:
    client = proxy.client()
    asked: dict[str, Any] = {"model": "m", "input": "Say hello", "top_logprobs": 2,
                             "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**asked)
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    row = proxy.completion(whole.id)
    assert [entry.logprob for entry in part.logprobs] == pytest.approx(list(row.output_logprobs))
    assert "".join(entry.token for entry in part.logprobs[:-1]) == GREETING  # then <|im_end|>
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert bytes(part.logprobs[0].bytes) == part.logprobs[0].token.encode()
    with client.responses.create(**asked, stream=True) as stream:
        events, final = collect_stream(stream)
    streamed = [entry.model_dump() for e in events if e.type == "response.output_text.delta"
                for entry in e.logprobs]
    final_part = final.output[0].content[0]
    assert final_part.logprobs == part.logprobs  # the completed response has every token's, as not streamed
    expected = [entry.model_dump() for entry in part.logprobs]
    assert streamed == expected[:len(streamed)] and len(streamed) >= len(expected) - 1  # not <|im_end|>
