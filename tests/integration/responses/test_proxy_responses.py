"""The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`) through the real proxy, driven by
the real `openai` client over HTTP: a scripted worker spells its replies with the tiny model's tokenizer
(text, Hermes `<tool_call>` markup), and every call must leave a completion recorded token-exactly: its
prompt ids are the chat template's rendering of the request's items, its output ids the worker's."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from tests.support.proxy_harness import Proxy
from tests.support.responses_api import (
    ANSWER,
    CHAT_TOOLS,
    GREETING,
    JSON_ANSWER,
    QUESTION,
    TOOLS,
    assert_response_recorded,
    collect_stream,
    full_prompt,
    function_calls,
    rendered,
    worker_inputs,
)
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript


def test_string_input_answers_a_response_and_records_the_rendered_prompt(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    client = proxy.client()
    response = client.responses.create(model="m", input="Say hello", extra_body={"not_a_field": 1})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == "m"
    assert response.output_text == GREETING
    message = response.output[0]
    assert message.type == "message" and message.id.startswith("msg_") and message.status == "completed"
    prompt_ids = rendered(script, [{"role": "user", "content": "Say hello"}])
    assert worker_inputs(worker) == [prompt_ids]
    assert response.usage is not None
    assert response.usage.input_tokens == len(prompt_ids)
    assert response.usage.output_tokens == len(script.output_ids(prompt_ids))
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    row = assert_response_recorded(proxy, script, response.id, prompt_ids)
    assert row.finish_reason == "stop" and row.request_json["input"] == "Say hello"

    again = client.responses.retrieve(response.id)  # store defaults to true
    assert again.model_dump() == response.model_dump()


def test_items_with_instructions_and_content_parts(proxy: Proxy, script: TextScript) -> None:
    items = [
        {"role": "developer", "content": "Answer in English."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"role": "user", "content": "Again please"},
    ]
    response = proxy.client().responses.create(model="m", instructions="Be brief.", input=items)  # type: ignore[arg-type]
    assert response.output_text == GREETING and response.instructions == "Be brief."
    messages = [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again please"},
    ]
    assert_response_recorded(proxy, script, response.id, rendered(script, messages))


def test_function_tool_round_trip_resends_the_whole_input(
    proxy: Proxy, script: TextScript, worker: ScriptedWorker
) -> None:
    client = proxy.client()
    user = {"role": "user", "content": QUESTION}
    first = client.responses.create(model="m", input=[user], tools=TOOLS)  # type: ignore[arg-type,list-item]
    calls = function_calls(first)
    assert len(calls) == 1 and first.output == calls  # no text besides the call
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    assert first.status == "completed" and first.tools[0].name == "get_weather"  # type: ignore[union-attr]
    assert_response_recorded(proxy, script, first.id, rendered(script, [user], CHAT_TOOLS))

    # Turn 2 as agents send it: the user message, the function_call item, then its output.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"degrees": 21}'}
    second = client.responses.create(
        model="m", tools=TOOLS, input=[user, call.model_dump(exclude_none=True), output],  # type: ignore[arg-type,list-item]
    )
    assert second.output_text == ANSWER and not function_calls(second)
    messages = [
        user,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"degrees": 21}'},
    ]
    assert_response_recorded(proxy, script, second.id, rendered(script, messages, CHAT_TOOLS))
    assert "<tool_response>" in script.prompts[-1]
    # Turn 2 extends turn 1: chained onto it, history never re-tokenised; the worker saw that prompt.
    row = proxy.completion(second.id)
    assert row.parent_id == first.id and not row.branched
    assert worker_inputs(worker)[-1] == full_prompt(proxy, second.id)
    assert row.request_json["chat_view"]["messages"] == [messages[-1]]  # only the new message


def test_previous_response_id_chains_stored_responses(proxy: Proxy, script: TextScript) -> None:
    client = proxy.client()
    user = {"role": "user", "content": QUESTION}
    first = client.responses.create(model="m", input=QUESTION, tools=TOOLS)  # type: ignore[arg-type]
    call = function_calls(first)[0]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"degrees": 21}'}
    chained = client.responses.create(
        model="m", tools=TOOLS, previous_response_id=first.id, input=[output],  # type: ignore[arg-type,list-item]
    )
    assert chained.output_text == ANSWER and chained.previous_response_id == first.id
    resent = client.responses.create(
        model="m", tools=TOOLS, input=[user, call.model_dump(exclude_none=True), output],  # type: ignore[arg-type,list-item]
    )
    row = proxy.completion(chained.id)
    assert full_prompt(proxy, chained.id) == full_prompt(proxy, resent.id)  # the same prompt either way
    assert row.request_json["input"] == [output]  # the record keeps what the client sent
    # Both continue the first turn in the session's conversation tree: only the suffix is recorded.
    assert row.parent_id == proxy.completion(resent.id).parent_id == first.id
    assert not row.branched and list(row.prompt_ids) == list(proxy.completion(resent.id).prompt_ids)
    assert len(row.prompt_ids) < len(full_prompt(proxy, chained.id))

    third = client.responses.create(model="m", previous_response_id=chained.id, input="Thanks, tell a story")
    messages = [
        user,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"degrees": 21}'},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "Thanks, tell a story"},
    ]
    assert_response_recorded(proxy, script, third.id, rendered(script, messages))  # no tools: not re-sent
    assert proxy.completion(third.id).branched  # a new tool list is a changed history (a branch)


def test_previous_response_id_unknown_other_session_or_unstored_is_404(
    proxy: Proxy, script: TextScript
) -> None:
    client = proxy.client()
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="m", input="hi", previous_response_id="resp_doesnotexist")
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    mine = client.responses.create(model="m", input="Say hello")
    _, other_key = proxy.new_session_key()
    other = proxy.client(other_key)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="m", input="hi", previous_response_id=mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    admin = proxy.client(proxy.admin_key)
    assert admin.responses.retrieve(mine.id).output_text == GREETING  # an admin key sees every session
    chained = admin.responses.create(model="m", input="Again", previous_response_id=mine.id)
    assert chained.output_text == GREETING

    unstored = client.responses.create(model="m", input="Say hello", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    proxy.completion(unstored.id)  # recorded for training all the same
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(proxy.completions()[0].id.replace("resp_", "chatcmpl-"))


def test_max_output_tokens_makes_an_incomplete_response(proxy: Proxy, script: TextScript) -> None:
    client = proxy.client()
    response = client.responses.create(model="m", input="Tell a story", max_output_tokens=5)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]
    row = proxy.completion(response.id)
    assert row.finish_reason == "length" and len(row.output_ids) == 5
    assert list(row.output_ids) == script.output_ids(list(row.prompt_ids))[:5]
    with client.responses.create(model="m", input="Tell a story", max_output_tokens=5, stream=True) as stream:
        events, final = collect_stream(stream)
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.output_text == response.output_text


def test_unsupported_tools_and_items_are_openai_shaped_400s(proxy: Proxy) -> None:
    client = proxy.client()
    with pytest.raises(openai.BadRequestError) as tool:
        client.responses.create(model="m", input="hi", tools=[{"type": "apply_patch"}])  # type: ignore[list-item]
    assert "apply_patch" in tool.value.message and tool.value.body["param"] == "tools[0]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as item:
        client.responses.create(model="m", input=[{"type": "item_reference", "id": "x"}])  # type: ignore[list-item]
    assert item.value.body["param"] == "input[0]"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model="m", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],  # type: ignore[misc]
        )
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="hi", temperature=3)
    assert proxy.count_completions() == 0


class Weather(BaseModel):
    city: str
    degrees: int


def test_responses_parse_reads_structured_output(proxy: Proxy) -> None:
    parsed = proxy.client().responses.parse(model="m", input="Give the forecast as JSON", text_format=Weather)
    assert parsed.output_parsed == Weather(city="Paris", degrees=21)
    assert parsed.output_text == JSON_ANSWER


def test_chat_and_responses_turns_chain_onto_each_other(proxy: Proxy, script: TextScript) -> None:
    client = proxy.client()
    user = {"role": "user", "content": QUESTION}
    chat = client.chat.completions.create(model="m", messages=[user], tools=CHAT_TOOLS)  # type: ignore[arg-type,list-item]
    call = (chat.choices[0].message.tool_calls or [])[0]
    items = [
        user,
        {"type": "function_call", "call_id": call.id, "name": call.function.name,  # type: ignore[union-attr]
         "arguments": call.function.arguments},  # type: ignore[union-attr]
        {"type": "function_call_output", "call_id": call.id, "output": '{"degrees": 21}'},
    ]
    response = client.responses.create(model="m", tools=TOOLS, input=items)  # type: ignore[arg-type]
    assert response.output_text == ANSWER
    assert proxy.completion(response.id).parent_id == chat.id
    follow_up = [
        user, chat.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"degrees": 21}'},
        {"role": "assistant", "content": response.output_text}, {"role": "user", "content": "And a story?"},
    ]
    last = client.chat.completions.create(model="m", messages=follow_up, tools=CHAT_TOOLS)  # type: ignore[arg-type]
    row = proxy.completion(last.id)
    assert row.parent_id == response.id and not row.branched
    assert last.choices[0].message.content == ANSWER
