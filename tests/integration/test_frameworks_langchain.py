"""langchain-openai's `ChatOpenAI` against the real proxy with bound tools: `invoke` gives an AIMessage with
parsed tool_calls, the ToolMessage goes back and the model answers; `stream` gives chunks that aggregate
to the same calls. The scripted worker spells Hermes `<tool_call>` text with the served tokenizer, and
every call leaves a completion recorded token-exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.support.proxy_harness import Proxy, ProxyFactory, install_script
from tests.support.recorded import assert_token_exact, output_text
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript


@tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """Current weather in a city."""
    return json.dumps({"city": city, "degrees": 21, "unit": unit})


CALLS = (
    'I will look both up.\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}\n</tool_call>'
)
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "unit": "fahrenheit"})]
ANSWER = "Paris is 21 celsius and Oslo is 21 fahrenheit."
QUESTION = "What is the weather in Paris and in Oslo?"


def reply(prompt: str) -> str:
    return ANSWER if "<tool_response>" in prompt else CALLS


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, worker: ScriptedWorker) -> Proxy:
    return proxies.start([worker.url])


def chat_model(proxy: Proxy, **kwargs: Any) -> Any:
    """`ChatOpenAI(...).bind_tools([get_weather])` as a user would write it, pointed at the proxy."""
    llm = ChatOpenAI(base_url=proxy.v1, api_key=proxy.session_key, model="m", max_retries=0, **kwargs)  # type: ignore[arg-type]
    return llm.bind_tools([get_weather])


def calls_of(message: AIMessage) -> list[tuple[str, dict[str, Any]]]:
    return [(call["name"], call["args"]) for call in message.tool_calls]


def run_tools(message: AIMessage) -> list[ToolMessage]:
    """The tool results a LangChain agent loop sends back."""
    return [get_weather.invoke(call) for call in message.tool_calls]


def test_invoke_with_bound_tools_then_the_tool_results_give_the_answer(
    proxy: Proxy, worker: ScriptedWorker, script: TextScript
) -> None:
    model = chat_model(proxy)
    history: list[BaseMessage] = [HumanMessage(QUESTION)]
    first = model.invoke(history)
    assert isinstance(first, AIMessage)
    assert calls_of(first) == EXPECTED
    assert first.content == "I will look both up."
    assert first.response_metadata["finish_reason"] == "tool_calls"
    assert all(call["id"] and call["id"].startswith("call_") for call in first.tool_calls)
    assert not first.invalid_tool_calls

    results = run_tools(first)
    assert [r.tool_call_id for r in results] == [call["id"] for call in first.tool_calls]
    second = model.invoke([*history, first, *results])
    assert second.content == ANSWER and not second.tool_calls
    assert second.response_metadata["finish_reason"] == "stop"
    assert '"degrees": 21' in script.prompts[-1] and script.prompts[-1].count("<tool_response>") == 2

    rows = proxy.completions()
    assert_token_exact(rows, worker, script)
    assert [row.id for row in rows] == [first.response_metadata["id"], second.response_metadata["id"]]
    assert output_text(rows[0], script) == CALLS and output_text(rows[1], script) == ANSWER
    assert rows[1].parent_id == rows[0].id and not rows[1].branched  # one conversation, continued
    assert all(row.session_id == proxy.session_id for row in rows)
    assert usage(first) == (len(rows[0].prompt_ids), len(rows[0].output_ids))


def usage(message: AIMessage) -> tuple[int, int]:
    assert message.usage_metadata is not None
    return message.usage_metadata["input_tokens"], message.usage_metadata["output_tokens"]


def test_streamed_tool_call_chunks_aggregate_to_the_invoked_calls(
    proxy: Proxy, worker: ScriptedWorker, script: TextScript
) -> None:
    model = chat_model(proxy, stream_usage=True)
    invoked = model.invoke([HumanMessage(QUESTION)])
    chunks = list(model.stream([HumanMessage(QUESTION)]))
    assert all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    assert sum(bool(chunk.tool_call_chunks) for chunk in chunks) >= 2  # the calls arrived as deltas
    streamed = chunks[0]
    for chunk in chunks[1:]:
        streamed += chunk
    assert isinstance(streamed, AIMessageChunk)
    assert calls_of(streamed) == calls_of(invoked) == EXPECTED
    assert streamed.content == invoked.content == "I will look both up."
    assert streamed.response_metadata["finish_reason"] == "tool_calls"
    assert not streamed.invalid_tool_calls

    # The streamed round trip: the aggregated message goes back with the tool results.
    answer = "".join(str(chunk.content) for chunk in model.stream(
        [HumanMessage(QUESTION), streamed, *run_tools(streamed)]))
    assert answer == ANSWER

    rows = proxy.completions()
    assert_token_exact(rows, worker, script)
    assert [output_text(row, script) for row in rows] == [CALLS, CALLS, ANSWER]
    assert [row.request_json.get("stream", False) for row in rows] == [False, True, True]
    assert usage(streamed) == (len(rows[1].prompt_ids), len(rows[1].output_ids))
    assert rows[2].parent_id in {rows[0].id, rows[1].id}  # continues the conversation it extends
