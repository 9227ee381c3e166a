"""The plain `openai` client against the real proxy, filling what test_proxy_chat.py and test_proxy_tools.py
leave out: a tool round trip streamed end to end (sync), the async client's tool round trip with several
conversations at once, and the client's own helpers (`chat.completions.stream` with a pydantic tool and
`chat.completions.parse`). Every call leaves a completion recorded token-exactly: the prompt the worker
got (rebuilt from the conversation's chain) and the tokens it generated."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.support.chat_stream import assemble_stream
from tests.support.proxy_harness import Proxy, ProxyFactory, install_script
from tests.support.recorded import assert_token_exact, output_text
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str


TOOLS: list[Any] = [openai.pydantic_function_tool(GetWeather, name="get_weather")]
CITIES = ["Paris", "Oslo", "Lima", "Kyoto"]


def question(city: str) -> list[Any]:
    return [{"role": "user", "content": f"Weather in {city}?"}]


def call_text(city: str) -> str:
    call = json.dumps({"name": "get_weather", "arguments": {"city": city}})
    return f"Checking {city}.\n<tool_call>\n{call}\n</tool_call>"


def answer_text(city: str) -> str:
    return f"{city} is 21 degrees."


def reply(prompt: str) -> str:
    """A call for the city asked about, then the answer once the tool result is in the prompt."""
    city = re.findall(r"Weather in (\w+)\?", prompt)[-1]
    return answer_text(city) if "<tool_response>" in prompt else call_text(city)


def tool_result(call_id: str, city: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"city": city, "degrees": 21})}


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, worker: ScriptedWorker) -> Proxy:
    return proxies.start([worker.url])


def test_sync_streamed_tool_round_trip(proxy: Proxy, worker: ScriptedWorker, script: TextScript) -> None:
    client = proxy.client()
    first = assemble_stream(client.chat.completions.create(
        model="m", messages=question("Paris"), tools=TOOLS, stream=True,
        stream_options={"include_usage": True},
    ))
    assert first["finish"] == "tool_calls" and first["content"] == "Checking Paris."
    (call,) = first["calls"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}

    function = {"name": call["name"], "arguments": call["arguments"]}
    assistant = {"role": "assistant", "content": first["content"],
                 "tool_calls": [{"id": call["id"], "type": "function", "function": function}]}
    second = assemble_stream(client.chat.completions.create(
        model="m", messages=[*question("Paris"), assistant, tool_result(call["id"], "Paris")],
        tools=TOOLS, stream=True,
    ))
    assert second == {"content": answer_text("Paris"), "reasoning": "", "finish": "stop", "calls": []}

    rows = proxy.completions()
    assert_token_exact(rows, worker, script)
    assert [output_text(row, script) for row in rows] == [call_text("Paris"), answer_text("Paris")]
    assert rows[1].parent_id == rows[0].id and not rows[1].branched
    assert rows[0].response_json["choices"][0]["message"]["tool_calls"][0]["id"] == call["id"]


async def conversation(client: openai.AsyncOpenAI, city: str, stream: bool) -> str:
    """One tool round trip on the async client; the answer's text."""
    messages = question(city)
    if stream:
        chunks = [chunk async for chunk in await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, stream=True)]
        deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or ()]
        assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
        call_id = deltas[0].id  # the first delta names the call, the rest carry its arguments
        arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    else:
        message = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0]
        assert message.finish_reason == "tool_calls"
        (tool_call,) = message.message.tool_calls or []
        call_id, arguments = tool_call.id, tool_call.function.arguments
    assert json.loads(arguments or "") == {"city": city}
    assistant = {"role": "assistant", "content": f"Checking {city}.", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    ]}
    final = await client.chat.completions.create(
        model="m", messages=[*messages, assistant, tool_result(call_id or "", city)], tools=TOOLS)
    return final.choices[0].message.content or ""


async def test_async_tool_round_trips_run_concurrently(
    proxy: Proxy, worker: ScriptedWorker, script: TextScript
) -> None:
    client = proxy.async_client()
    try:
        answers = await asyncio.gather(*(
            conversation(client, city, stream=i % 2 == 1) for i, city in enumerate(CITIES)))
    finally:
        await client.close()
    assert answers == [answer_text(city) for city in CITIES]

    rows = proxy.completions()
    assert_token_exact(rows, worker, script)
    kinds = {call_text(c): ("call", c) for c in CITIES} | {answer_text(c): ("answer", c) for c in CITIES}
    assert sorted(kinds[output_text(row, script)] for row in rows) == sorted(kinds.values())
    by_id = {row.id: row for row in rows}
    for row in rows:  # each answer continues its own conversation's call; calls start conversations
        kind, city = kinds[output_text(row, script)]
        if kind == "answer":
            assert output_text(by_id[row.parent_id or ""], script) == call_text(city) and not row.branched
        else:
            assert row.parent_id is None


def test_client_stream_helper_and_parse_read_the_pydantic_tool(
    proxy: Proxy, worker: ScriptedWorker, script: TextScript
) -> None:
    client = proxy.client()
    with client.chat.completions.stream(model="m", messages=question("Lima"), tools=TOOLS) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        streamed = stream.get_final_completion()
    assert [(e.name, e.parsed_arguments) for e in done] == [("get_weather", GetWeather(city="Lima"))]
    parsed = client.chat.completions.parse(model="m", messages=question("Lima"), tools=TOOLS)
    for completion in (streamed, parsed):
        (tool_call,) = completion.choices[0].message.tool_calls or []
        assert tool_call.function.parsed_arguments == GetWeather(city="Lima")
        assert completion.choices[0].finish_reason == "tool_calls"

    rows = proxy.completions()
    assert_token_exact(rows, worker, script)
    assert [row.id for row in rows] == [streamed.id, parsed.id]
    assert [output_text(row, script) for row in rows] == [call_text("Lima")] * 2
    assert rows[0].request_json["tools"][0]["function"]["strict"] is True  # the helper's strict schema
