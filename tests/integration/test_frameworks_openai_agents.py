"""`openai-agents` against the proxy: an Agent with one function tool, run by `Runner` on the SDK's
Responses model and on its Chat Completions model, each with an `AsyncOpenAI` client on a session key.
The scripted worker (tiny model tokenizer) calls the tool first, then answers from its result; each run
leaves two completions recorded token-exactly (the prompts the worker saw, the ids it generated)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import (
    Agent,
    Model,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from tests.support.proxy_harness import Proxy, ProxyFactory, install_script
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "The weather in Paris is sunny and 21 degrees."
TOOL_RESULT = "sunny, 21 degrees"


def reply(prompt: str) -> str:
    return ANSWER if TOOL_RESULT in prompt else CALL


@function_tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return TOOL_RESULT if city == "Paris" else "unknown"


@pytest.fixture(autouse=True)
def no_tracing() -> Iterator[None]:
    set_tracing_disabled(True)  # the SDK would export traces to api.openai.com
    yield
    set_tracing_disabled(False)


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, worker: ScriptedWorker) -> Proxy:
    return proxies.start([worker.url])


def weather_agent(model: Model) -> Agent[Any]:
    return Agent(name="forecaster", instructions="Use the tool to answer.", tools=[get_weather], model=model)


def assert_two_recorded_turns(proxy: Proxy, script: TextScript, worker: ScriptedWorker, prefix: str) -> None:
    """The tool call then the answer, each recorded with the worker's exact prompt and output ids."""
    rows = proxy.completions()
    assert [row.id.startswith(prefix) for row in rows] == [True, True]
    # The answer continues the tool call's conversation: recorded as the suffix after its prompt and output.
    assert rows[1].parent_id == rows[0].id and rows[0].parent_id is None and not rows[1].branched
    prompts = [list(rows[0].prompt_ids), [*rows[0].prompt_ids, *rows[0].output_ids, *rows[1].prompt_ids]]
    assert [[int(t) for t in p] for p in prompts] == [
        r.body["input_ids"] for r in worker.requests if r.path == "/generate"
    ]
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.session_id == proxy.session_id
        assert list(row.output_ids) == script.output_ids(prompt)
        assert len(row.output_logprobs) == len(row.output_versions) == len(row.output_ids)
    first, second = (script.tokenizer.decode(prompt) for prompt in prompts)
    assert "Use the tool to answer." in first and "get_weather" in first and TOOL_RESULT not in first
    assert f"<tool_response>\n{TOOL_RESULT}\n</tool_response>" in second
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in second


async def test_runner_on_the_responses_model(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    model = OpenAIResponsesModel(model="m", openai_client=proxy.async_client())
    result = await Runner.run(weather_agent(model), "What is the weather in Paris?")
    assert result.final_output == ANSWER
    assert [item.type for item in result.new_items] == [
        "tool_call_item", "tool_call_output_item", "message_output_item",
    ]
    assert_two_recorded_turns(proxy, script, worker, "resp_")


async def test_runner_chaining_responses_by_previous_response_id(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    """The SDK sends only the new items (the tool output) with the first response's id."""
    model = OpenAIResponsesModel(model="m", openai_client=proxy.async_client())
    result = await Runner.run(
        weather_agent(model), "What is the weather in Paris?", auto_previous_response_id=True
    )
    assert result.final_output == ANSWER
    bodies = [r.body for r in worker.requests if r.path == "/generate"]
    assert len(bodies) == 2
    rows = proxy.completions()
    assert rows[1].request_json["previous_response_id"] == rows[0].id
    assert all(item.get("type") == "function_call_output" for item in rows[1].request_json["input"])
    assert_two_recorded_turns(proxy, script, worker, "resp_")


async def test_runner_streamed_on_the_responses_model(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    model = OpenAIResponsesModel(model="m", openai_client=proxy.async_client())
    run = Runner.run_streamed(weather_agent(model), "What is the weather in Paris?")
    kinds = [event.type async for event in run.stream_events()]
    assert run.final_output == ANSWER
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert_two_recorded_turns(proxy, script, worker, "resp_")


async def test_runner_on_the_chat_completions_model(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    model = OpenAIChatCompletionsModel(model="m", openai_client=proxy.async_client())
    result = await Runner.run(weather_agent(model), "What is the weather in Paris?")
    assert result.final_output == ANSWER
    assert_two_recorded_turns(proxy, script, worker, "chatcmpl-")
