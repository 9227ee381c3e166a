"""The Responses API tests' scripted model and readers: what the scripted worker replies to each prompt
(text, Hermes `<tool_call>` markup, a `<think>` block, JSON, a long story), the prompt ids the chat
template gives chat messages, what the worker received, and what the proxy recorded for a response."""

from __future__ import annotations

from typing import Any

from tests.support.proxy_harness import Proxy
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

TOOLS = [{
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 21 degrees in Paris."
GREETING = "Hello! How can I help you today?"
JSON_ANSWER = '{"city": "Paris", "degrees": 21}'
STORY = " ".join(["once upon a time there was a small model that told long stories"] * 12)
QUESTION = "What is the weather in Paris?"
THINKING = "<think>\nThe user wants a greeting.\n</think>\n\n"


def reply(prompt: str) -> str:
    """What the scripted model answers to this prompt text (install it with `install_script`)."""
    if "Think first" in prompt:
        return THINKING + GREETING
    if "<tool_response>" in prompt:
        return ANSWER
    if "Oslo" in prompt:
        return "Let me check.\n" + CALL.replace("Paris", "Oslo")
    if "weather" in prompt:
        return CALL
    if "as JSON" in prompt:
        return JSON_ANSWER
    if "story" in prompt:
        return STORY
    return GREETING


def rendered(script: TextScript, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
             ) -> list[int]:
    """The prompt ids the chat template gives these chat messages."""
    text = script.tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return list(script.tokenizer.encode(text, add_special_tokens=False))


def worker_inputs(worker: ScriptedWorker) -> list[list[int]]:
    return [r.body["input_ids"] for r in worker.requests if r.path == "/generate"]


def full_prompt(proxy: Proxy, completion_id: str) -> list[int]:
    """A completion's whole prompt: a chained one records only its suffix after the parent's prompt and
    output."""
    row = proxy.completion(completion_id)
    if row.parent_id is None:
        return list(row.prompt_ids)
    parent = proxy.completion(row.parent_id)
    return [*full_prompt(proxy, parent.id), *parent.output_ids.tolist(), *row.prompt_ids.tolist()]


def assert_response_recorded(
    proxy: Proxy, script: TextScript, response_id: str, prompt_ids: list[int]
) -> Any:
    """The call's completion: the rendered prompt, the worker's exact output ids (end of turn included)."""
    row = proxy.completion(response_id)
    recorded = full_prompt(proxy, response_id)
    assert script.tokenizer.decode(recorded) == script.tokenizer.decode(prompt_ids)
    assert recorded == prompt_ids
    assert list(row.output_ids) == script.output_ids(prompt_ids)
    assert len(row.output_logprobs) == len(row.output_versions) == len(row.output_ids)
    assert row.response_json["id"] == response_id and row.response_json["object"] == "response"
    return row


def collect_stream(stream: Any) -> tuple[list[Any], Any]:
    """A streamed response's events, numbered in order, and the response its last event carries."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events, events[-1].response


def function_calls(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]
