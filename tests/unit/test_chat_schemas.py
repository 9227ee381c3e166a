"""The chat completion request schema (proxy/openai/schemas.py): validation errors that name the field
(described by proxy/errors.py), and messages as the chat template gets them."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from proxy.errors import describe_validation_errors
from proxy.openai.schemas import ChatCompletionRequest


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({}, "messages", "missing_required_parameter"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n", "invalid_value"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop", "invalid_type"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0]",
         "invalid_value"),
        ({"messages": [{"role": "tool"}]}, "messages[0]", "invalid_value"),
    ],
)
def test_validation_errors_name_the_field(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate(body)
    errors = [{**e, "loc": ("body", *e["loc"])} for e in error.value.errors()]
    message, named, kind = describe_validation_errors(errors)
    assert (named, kind) == (param, code) and param in message


def test_content_parts_flatten_and_tool_arguments_become_objects() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"k": 1}'}}]},
    ], "brand_new_field": True})
    user, assistant = body.template_messages()
    assert user == {"role": "user", "content": "a\nb"}
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"k": 1}}
