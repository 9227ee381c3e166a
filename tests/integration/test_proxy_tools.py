"""Tool calls and reasoning through the real proxy, driven by the real `openai` client: a scripted worker
spells Hermes/Qwen `<tool_call>` text (and `<think>` blocks) with the served tokenizer; the proxy
answers with OpenAI `tool_calls` and `reasoning_content`, streamed and not, while the recorded
completion keeps the exact generated tokens, markup included."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support import scripted_worker
from tests.support.chat_stream import assemble_stream
from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory, install_script
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
THINKING = "<think>\nI should look it up.\n</think>\n\n"
CALLS = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
)
ANSWER = "Paris is 21 and Oslo is 12 degrees."
QUESTION = [{"role": "user", "content": "Weather in Paris and Oslo?"}]


def tool_agent_reply(prompt: str) -> str:
    return ANSWER if "<tool_response>" in prompt else CALLS


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, tool_agent_reply, monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, worker: ScriptedWorker) -> Proxy:
    return proxies.start([worker.url])


def name_and_arguments(calls: Sequence[Any]) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


EXPECTED_CALLS = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "unit": "celsius"})]


def test_non_stream_tool_call_round_trip(proxy: Proxy, script: TextScript) -> None:
    client = proxy.client()
    first = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_CALLS
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert "<tools>" in script.prompts[-1]  # the tools reached the chat template

    results = [{"role": "tool", "tool_call_id": c.id, "content": '{"degrees": 21}'} for c in calls]
    second = client.chat.completions.create(
        model="m", tools=TOOLS,  # type: ignore[arg-type]
        messages=[*QUESTION, choice.message.model_dump(exclude_none=True), *results],  # type: ignore[list-item]
    )
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == ANSWER and not second.choices[0].message.tool_calls
    assert script.prompts[-1].count("<tool_response>") == 2
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in script.prompts[-1]

    row = proxy.completion(first.id)  # the record keeps the generated tokens, markup and all
    assert script.tokenizer.decode(list(row.output_ids[:-1])) == CALLS
    assert int(row.output_ids[-1]) == script.eos
    assert row.response_json["choices"][0]["message"]["tool_calls"][0]["id"] == calls[0].id


def test_streamed_tool_call_equals_the_non_streamed_one_and_records_exact_tokens(
    proxy: Proxy, script: TextScript
) -> None:
    client = proxy.client()
    whole = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model="m", messages=QUESTION, tools=TOOLS, stream=True, logprobs=True,  # type: ignore[arg-type]
    )
    streamed = assemble_stream(stream)
    whole_calls = [{"name": c.function.name, "arguments": c.function.arguments}
                   for c in whole.choices[0].message.tool_calls or []]
    assert name_and_arguments(streamed["calls"]) == name_and_arguments(whole_calls) == EXPECTED_CALLS
    assert [c["arguments"] for c in streamed["calls"]] == [c["arguments"] for c in whole_calls]
    assert streamed["content"] == whole.choices[0].message.content == "Let me check."
    assert streamed["finish"] == "tool_calls"

    recorded = [c for c in proxy.completions() if c.id != whole.id]
    assert len(recorded) == 1
    row = recorded[0]
    assert script.tokenizer.decode(list(row.output_ids[:-1])) == CALLS  # the raw text, markup included
    assert int(row.output_ids[-1]) == script.eos
    assert len(row.output_logprobs) == len(row.output_ids)
    message = row.response_json["choices"][0]["message"]
    assert [c["id"] for c in message["tool_calls"]] == [c["id"] for c in streamed["calls"]]
    assert row.response_json["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_logprobs_with_bytes_equal_the_non_streamed_ones(proxy: Proxy, script: TextScript) -> None:
    """Tokens whose text the parser holds back still get their logprobs, once each and in order."""
    client = proxy.client()
    kwargs: dict[str, Any] = {
        "model": "m", "messages": QUESTION, "tools": TOOLS, "logprobs": True, "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs
    assert whole is not None and whole.content is not None
    streamed = [entry for chunk in client.chat.completions.create(**kwargs, stream=True)
                for choice in chunk.choices
                for entry in (choice.logprobs.content or [] if choice.logprobs else [])]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.content]
    assert all(len(e.top_logprobs) == 2 for e in streamed)
    assert len(streamed) == len(script.tokenizer.encode(CALLS, add_special_tokens=False)) + 1
    assert b"".join(bytes(e.bytes or ()) for e in streamed[:-1]).decode() == CALLS


def test_parallel_tool_calls_false_keeps_the_first_call(proxy: Proxy) -> None:
    client = proxy.client()
    kwargs: dict[str, Any] = {
        "model": "m", "messages": QUESTION, "tools": TOOLS, "parallel_tool_calls": False,
    }
    whole = client.chat.completions.create(**kwargs)
    streamed = assemble_stream(client.chat.completions.create(**kwargs, stream=True))
    calls = whole.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == EXPECTED_CALLS[:1]
    assert name_and_arguments(streamed["calls"]) == EXPECTED_CALLS[:1]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_gives_plain_content_and_no_tools_in_the_prompt(
    proxy: Proxy, script: TextScript, stream: bool
) -> None:
    client = proxy.client()
    kwargs: dict[str, Any] = {"model": "m", "messages": QUESTION, "tools": TOOLS, "tool_choice": "none"}
    if stream:
        result = assemble_stream(client.chat.completions.create(**kwargs, stream=True))
        content, calls, finish = result["content"], result["calls"], result["finish"]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
    assert content == CALLS and not calls and finish == "stop"
    assert "<tools>" not in script.prompts[-1]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_required_and_named_tool_choice_are_accepted_and_parsed(proxy: Proxy, tool_choice: Any) -> None:
    response = proxy.client().chat.completions.create(
        model="m", messages=QUESTION, tools=TOOLS, tool_choice=tool_choice,  # type: ignore[arg-type]
    )
    assert response.choices[0].finish_reason == "tool_calls"
    assert len(response.choices[0].message.tool_calls or []) == 2


def test_reasoning_content_when_configured(
    proxies: ProxyFactory, servers: LoopThread, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = TextScript(tiny_model_dir, lambda prompt: THINKING + tool_agent_reply(prompt))
    monkeypatch.setattr(scripted_worker, "token_text", script.text)
    worker = servers.start_scripted(token_fn=script, eos_token_id=script.eos)
    try:
        proxy = proxies.start([worker.url], reasoning_parser="qwen3")
        client = proxy.client()
        whole = client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
        message = whole.choices[0].message
        assert (message.model_extra or {}).get("reasoning_content") == "I should look it up."
        assert message.content == "Let me check."
        assert whole.choices[0].finish_reason == "tool_calls"
        streamed = assemble_stream(
            client.chat.completions.create(model="m", messages=QUESTION, tools=TOOLS, stream=True)  # type: ignore[arg-type]
        )
        assert streamed["reasoning"] == "I should look it up."
        assert streamed["content"] == "Let me check."
        assert name_and_arguments(streamed["calls"]) == EXPECTED_CALLS

        plain = proxies.start([worker.url])  # no reasoning parser: the <think> block is content
        answer = plain.client().chat.completions.create(model="m", messages=QUESTION)
        assert answer.choices[0].message.content == THINKING + CALLS
    finally:
        servers.call(worker.stop())
