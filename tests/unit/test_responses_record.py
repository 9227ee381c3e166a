"""proxy/openai/responses/record.py: what a recorded Responses call teaches the conversation tree, so a
client that sends the response's items back chains onto it."""

from __future__ import annotations

from typing import Any

from proxy.conversations.tree import chat_record
from proxy.openai.responses.input import items_to_messages
from proxy.openai.responses.record import request_answered, request_with_view
from rewards.message_keys import message_key
from storage.records import CompletionRecord

CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": '{"x": 1}',
        "status": "completed"}


def _record(request_json: dict[str, Any], output: list[dict[str, Any]]) -> CompletionRecord:
    """The record of a Responses call, its request answered by `output` as the proxy records it."""
    response_json = {"object": "response", "output": output}
    if "chat_view" in request_json:
        request_json = request_answered(request_json, response_json)
    return CompletionRecord(
        id="resp_1", session_id="s", parent_id=None, prompt_ids=[1], output_ids=[2], output_logprobs=[0.0],
        output_versions=[0], finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1,
        request_json=request_json, response_json=response_json,
    )


def test_a_recorded_response_teaches_the_message_a_client_sends_back() -> None:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": "Let me see.", "annotations": []}]}
    new = [{"role": "user", "content": "q"}]
    keys = chat_record(_record(request_with_view({"input": "q"}, new, None), [message, CALL]))
    assert keys is not None
    resent = items_to_messages(None, [*new, message, {**CALL, "call_id": "other"}])
    assert keys == ([message_key(new[0])], None, message_key(resent[1]))  # call ids never matter
    assert chat_record(_record({"input": "q"}, [message])) is None  # no chat view: not learned
    assert chat_record(_record(request_with_view({}, new, None), [])) is None  # no answer: not learned
