"""The Messages API tests' scripted model and helpers: what the scripted worker replies to each prompt
(text, a Hermes `<tool_call>`, a `<think>` block, a stop sequence), the real `anthropic` client pointed at
a proxy, the prompt ids the chat template gives chat messages, and a raw reader of named SSE events."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx

from tests.support.proxy_harness import Proxy
from tests.support.text_script import TextScript

TOOLS: list[dict[str, Any]] = [{
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}]
SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": TOOLS[0]["description"],
                                                "parameters": TOOLS[0]["input_schema"]}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 21 degrees in Paris."
GREETING = "Hello! How can I help you today?"
THINKING = "<think>\nThe user wants a greeting.\n</think>\n\n"
COUNTING = "one two three STOP four five"
QUESTION = "What is the weather in Paris?"
THANKS = "Thanks! Anything else?"


def reply(prompt: str) -> str:
    """What the scripted model answers to this prompt text (install it with `install_script`)."""
    if prompt.rstrip().endswith("Thanks!<|im_end|>\n<|im_start|>assistant"):
        return THANKS
    if "Think first" in prompt:
        return THINKING + GREETING
    if "<tool_response>" in prompt:
        return ANSWER
    if "weather" in prompt:
        return CALL
    if "Count" in prompt:
        return COUNTING
    return GREETING


def client(proxy: Proxy, key: str | None = None, **kwargs: Any) -> anthropic.Anthropic:
    """The real Anthropic client on the proxy (it adds /v1/messages to the base URL)."""
    return anthropic.Anthropic(base_url=proxy.base_url, api_key=key or proxy.session_key, max_retries=0,
                               **kwargs)


def rendered(script: TextScript, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
             ) -> list[int]:
    """The prompt ids the chat template gives these chat messages."""
    text = script.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                add_generation_prompt=True)
    return list(script.tokenizer.encode(text, add_special_tokens=False))


def named_events(
    proxy: Proxy, body: dict[str, Any], headers: dict[str, str]
) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of a streamed `POST /v1/messages`, read raw."""
    events: list[tuple[str, dict[str, Any]]] = []
    with httpx.stream("POST", f"{proxy.v1}/messages", json={**body, "stream": True}, headers=headers,
                      timeout=30) as response:
        assert response.status_code == 200, response.read()
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                assert name is not None, line
                events.append((name, json.loads(line.removeprefix("data: "))))
                name = None
    return events


def blocks(message: Any) -> list[dict[str, Any]]:
    """A message's content blocks as plain JSON."""
    return [block.model_dump(exclude_none=True) for block in message.content]
