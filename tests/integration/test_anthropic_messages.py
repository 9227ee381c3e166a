"""Anthropic's Messages API through the real proxy, driven by the real `anthropic` client: a scripted
worker spells text, Hermes `<tool_call>`s and `<think>` blocks with the served tokenizer; the proxy
answers `message` objects (text, tool_use and thinking blocks, stop reasons, usage), streamed as named
events the SDK assembles into the same message, while each call is recorded token-exactly under its
`msg_…` id."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.support.anthropic_messages import (
    ANSWER,
    CALL,
    CHAT_TOOLS,
    GREETING,
    QUESTION,
    SERVER_TOOL,
    TOOLS,
    blocks,
    client,
    named_events,
    rendered,
    reply,
)
from tests.support.proxy_harness import Proxy, ProxyFactory, install_script
from tests.support.responses_api import worker_inputs
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

HELLO = [{"role": "user", "content": "Hello there."}]
# Wire behaviour, not storage: SQLite only (test_anthropic_multiturn.py writes trajectories on both).
pytestmark = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, worker: ScriptedWorker) -> Proxy:
    return proxies.start([worker.url])


def test_a_text_answer_is_one_message_streamed_or_not_recorded_token_exactly(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    sdk = client(proxy)
    message = sdk.messages.create(model="m", max_tokens=64, system="Be brief.", messages=HELLO,  # type: ignore[arg-type]
                                  extra_body={"temperature": 0})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert blocks(message) == [{"type": "text", "text": GREETING}]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    prompt_ids = rendered(script, [{"role": "system", "content": "Be brief."}, *HELLO])
    assert worker_inputs(worker) == [prompt_ids]
    assert message.usage.input_tokens == len(prompt_ids)
    assert message.usage.output_tokens == len(script.output_ids(prompt_ids))

    row = proxy.completion(message.id)  # the message's id is its completion's
    assert row.prompt_ids.tolist() == prompt_ids
    assert row.output_ids.tolist() == script.output_ids(prompt_ids)
    assert len(row.output_logprobs) == len(row.output_versions) == len(row.output_ids)
    assert row.response_json == message.model_dump(exclude_none=True) | {"stop_sequence": None}
    assert row.request_json["chat_view"]["answer"] == {"role": "assistant", "content": GREETING}

    worker.token_delay_s = 0.02  # tokens trickle in: each should go out as it comes
    with sdk.messages.stream(model="m", max_tokens=64, system="Be brief.", messages=HELLO,  # type: ignore[arg-type]
                             extra_body={"temperature": 0}) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == GREETING and len(texts) > 1  # relayed as the worker's tokens came
    assert blocks(final) == blocks(message)
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        "end_turn", message.usage.input_tokens, message.usage.output_tokens)
    streamed = proxy.completion(final.id)
    assert streamed.output_ids.tolist() == row.output_ids.tolist()
    assert streamed.response_json["content"] == [{"type": "text", "text": GREETING}]


def test_the_stream_is_anthropics_event_sequence_and_is_recorded_before_it_ends(
    proxy: Proxy, script: TextScript
) -> None:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": QUESTION}],
            "tools": TOOLS}
    events = named_events(proxy, body, {"x-api-key": proxy.session_key})
    names = [name for name, _data in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    block = events[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and block["input"] == {}
    assert events[3][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert events[5][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    row = proxy.completion(start["id"])
    assert events[5][1]["usage"] == {"output_tokens": len(row.output_ids)}
    assert row.response_json["content"] == [{**block, "input": {"city": "Paris"}}]


def test_a_tool_round_trip_chains_and_a_streamed_call_has_the_same_input(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    sdk = client(proxy)
    question = [{"role": "user", "content": QUESTION}]
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 128, "tools": [*TOOLS, SERVER_TOOL]}
    with sdk.messages.stream(messages=question, **kwargs) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    first = sdk.messages.create(messages=question, **kwargs)  # type: ignore[arg-type]
    assert first.stop_reason == streamed.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "get_weather",  # type: ignore[union-attr]
                                                                     {"city": "Paris"})]
    # Only the custom tool reaches the template: the server tool runs at Anthropic's, not here.
    assert worker_inputs(worker) == [rendered(script, question, CHAT_TOOLS)] * 2

    history = [*question, {"role": "assistant", "content": blocks(first)},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "21 degrees"}]}]}]
    second = sdk.messages.create(messages=history, **kwargs)  # type: ignore[arg-type]
    assert blocks(second) == [{"type": "text", "text": ANSWER}] and second.stop_reason == "end_turn"
    assert "<tool_response>\n21 degrees\n</tool_response>" in script.prompts[-1]
    row, parent = proxy.completion(second.id), proxy.completion(first.id)
    assert row.parent_id == first.id and not row.branched  # chained onto the latest call it answers
    assert worker_inputs(worker)[-1] == [*parent.prompt_ids.tolist(), *parent.output_ids.tolist(),
                                         *row.prompt_ids.tolist()]
    assert script.tokenizer.decode(parent.output_ids.tolist()[:-1]) == CALL  # the markup, as generated
    assert row.request_json["messages"] == history[2:]  # a child keeps only what its parent lacks


def test_stop_sequences_and_the_token_budget_give_their_stop_reasons(proxy: Proxy) -> None:
    sdk = client(proxy)
    kwargs: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Count to five."}]}
    stopped = sdk.messages.create(max_tokens=64, stop_sequences=["NEVER", "STOP"], **kwargs)
    assert blocks(stopped) == [{"type": "text", "text": "one two three "}]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "STOP")
    with sdk.messages.stream(max_tokens=64, stop_sequences=["STOP"], **kwargs) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(stopped)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "STOP")

    cut = sdk.messages.create(max_tokens=2, **kwargs)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_reasoning_is_a_thinking_block_and_sent_back_it_still_chains(
    proxies: ProxyFactory, worker: ScriptedWorker
) -> None:
    proxy = proxies.start([worker.url], reasoning_parser="qwen3")
    sdk = client(proxy)
    question = [{"role": "user", "content": "Think first, then greet me."}]
    message = sdk.messages.create(model="m", max_tokens=128, messages=question)  # type: ignore[arg-type]
    assert blocks(message) == [
        {"type": "thinking", "thinking": "The user wants a greeting.", "signature": ""},
        {"type": "text", "text": GREETING},
    ]
    with sdk.messages.stream(model="m", max_tokens=128, messages=question) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert blocks(streamed) == blocks(message)

    history = [*question, {"role": "assistant", "content": blocks(message)},
               {"role": "user", "content": "Thanks!"}]
    sdk.messages.create(model="m", max_tokens=128, messages=history)  # type: ignore[arg-type]
    rows = sorted(proxy.completions(), key=lambda r: r.created_at)
    assert rows[-1].parent_id == streamed.id and not rows[-1].branched  # the latest of the two equal turns


def test_a_stream_cut_off_ends_in_an_error_event_and_records_what_was_generated(
    proxy: Proxy, worker: ScriptedWorker
) -> None:
    worker.crash_after_tokens = 3  # the only worker dies mid-answer: nothing can resume it
    with pytest.raises(anthropic.APIStatusError) as raised:
        with client(proxy).messages.stream(model="m", max_tokens=64, messages=HELLO) as stream:  # type: ignore[arg-type]
            list(stream)
    body = raised.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] in ("api_error", "overloaded_error") and body["error"]["message"]
    [row] = proxy.completions()
    assert row.id.startswith("msg_") and row.finish_reason == "abort" and len(row.output_ids) == 3


def test_structured_output_and_forced_tools_reach_the_worker_as_grammars(
    proxy: Proxy, worker: ScriptedWorker
) -> None:
    sdk = client(proxy)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    sdk.messages.create(model="m", max_tokens=16, messages=HELLO,  # type: ignore[arg-type]
                        output_config={"format": {"type": "json_schema", "schema": schema}})
    question = [{"role": "user", "content": QUESTION}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}):
        message = sdk.messages.create(model="m", max_tokens=64, messages=question, tools=TOOLS,  # type: ignore[arg-type]
                                      tool_choice=choice)  # type: ignore[arg-type]
        assert message.stop_reason == "tool_use"
    sent = [request.body["sampling_params"] for request in worker.requests_to("/generate")]
    assert json.loads(sent[0]["json_schema"]) == schema
    assert ["structural_tag" in params for params in sent[1:]] == [True, True, False]
