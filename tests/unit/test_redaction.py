"""Redaction of stored JSON (proxy/privacy.py, proxy/recording/redaction.py): the built-in detectors and
their near misses, user patterns and their config errors, which strings of chat, legacy and Responses
JSON are text, logprob tokens masked where they overlap redacted text, records marked only when they
changed, and a reloaded conversation tree leaving redacted completions (and their descendants) out."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from pydantic import ValidationError

from flywheel.config import ConfigError, load_config
from proxy.conversations.index import chainable
from proxy.errors import OpenAIError
from proxy.privacy import REDACTED_MARK, PrivacyConfig, RedactionPattern, is_redacted
from proxy.recording.redaction import Redactor, refuse_redacted
from tests.support.completion_records import completion

PATTERNS = Redactor(PrivacyConfig(redact="patterns"))
ALL = Redactor(PrivacyConfig(redact="all", placeholder="<gone>"))
EMAIL = "alice.smith@example.co.uk"


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        (f"write to {EMAIL} today", "write to [EMAIL] today"),
        ("call +1 415 555 0100 or +44 20 7946 0958", "call [PHONE] or [PHONE]"),
        ("call (415) 555-0100 or 415.555.0100", "call [PHONE] or [PHONE]"),
        ("card 4111 1111 1111 1111, exp 12/29", "card [CARD], exp 12/29"),
        ("card 4111-1111-1111-1111", "card [CARD]"),
        ("from 192.168.10.254 to 10.0.0.1", "from [IP] to [IP]"),
        ("Authorization: Bearer abc.DEF-123_456", "Authorization: [SECRET]"),
        ("use sk-proj-AbCdEfGhIjKlMnOpQrSt please", "use [SECRET] please"),
        ("api_key=hunter2hunter2 and password: 'correct-horse'", "[SECRET] and [SECRET]'"),
        ("ghp_" + "a1" * 18, "[SECRET]"),
        ("key AKIAABCDEFGHIJKLMNOP here", "key [SECRET] here"),
    ],
)
def test_the_built_in_detectors_replace_what_they_match(text: str, redacted: str) -> None:
    assert PATTERNS.text(text) == redacted


@pytest.mark.parametrize(
    "text",
    [
        "The answer is 72.",
        "On 2024-01-15 she paid 12345678 cents, 3.14 each, 1,234,567 in all.",
        "version 1.2.3 of the library",
        "card 4111 1111 1111 1112 fails the Luhn check",
        "x = 555-0100",
        "the token limit is 4096",
        "an @ sign alone, or user@localhost",
    ],
)
def test_near_misses_are_kept(text: str) -> None:
    assert PATTERNS.text(text) is text


def test_only_the_chosen_detectors_run_and_user_patterns_come_first() -> None:
    config = PrivacyConfig(
        redact="patterns",
        detectors=["email"],
        patterns=[RedactionPattern(pattern=r"(?i)project\s+\w+", replacement="<project>")],
    )
    redactor = Redactor(config)
    assert redactor.text(f"Project Falcon: {EMAIL}, 10.0.0.1") == "<project>: [EMAIL], 10.0.0.1"
    # Overlapping matches merge into one span with the first rule's replacement.
    overlapping = Redactor(
        PrivacyConfig(redact="patterns", detectors=["email"], patterns=[{"pattern": r"alice\.\w+"}])
    )
    assert overlapping.text(f"to {EMAIL}") == "to [REDACTED]"
    # On the same start the first rule's replacement wins, however long the later rule's match.
    longer = Redactor(
        PrivacyConfig(redact="patterns", detectors=["email"], patterns=[{"pattern": r"alice\.\w+@\S+ today"}])
    )
    assert longer.text(f"to {EMAIL} today!") == "to [REDACTED]!"
    assert longer.text(f"to {EMAIL} now") == "to [EMAIL] now"


def test_a_replacement_is_literal_text() -> None:
    redactor = Redactor(
        PrivacyConfig(redact="patterns", detectors=[], patterns=[{"pattern": r"(\d+)", "replacement": r"\1"}])
    )
    assert redactor.text("room 101") == r"room \1"


@pytest.mark.parametrize(
    ("pattern", "error"),
    [("(unclosed", "is not a valid regular expression"), ("a*", "matches the empty string")],
)
def test_a_bad_pattern_is_a_config_error_naming_it(pattern: str, error: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_config(
            overrides=["proxy.privacy.redact=patterns", f"proxy.privacy.patterns=[{{pattern: '{pattern}'}}]"]
        )
    assert "proxy.privacy.patterns.0.pattern" in str(raised.value)
    assert repr(pattern) in str(raised.value) and error in str(raised.value)


def test_patterns_mode_needs_something_to_match() -> None:
    with pytest.raises(ValidationError, match="needs at least one of"):
        PrivacyConfig(redact="patterns", detectors=[])
    with pytest.raises(ValidationError):
        PrivacyConfig(redact="some")


def chat_request() -> dict[str, Any]:
    return {
        "model": "m",
        "user": EMAIL,
        "metadata": {"name": EMAIL, "id": "7"},
        "messages": [
            {"role": "system", "content": "You help."},
            {"role": "user", "name": "alice", "content": [{"type": "text", "text": f"I am {EMAIL}"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": f"mail {EMAIL}",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "send", "arguments": json.dumps({"to": EMAIL})},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "send", "arguments": {"name": EMAIL}},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": f"sent to {EMAIL}"},
        ],
        "tools": [{"type": "function", "function": {"name": "send", "description": f"mails {EMAIL}"}}],
        "tool_choice": "auto",
        "stop": [EMAIL],
        "temperature": 0.5,
    }


def test_patterns_redact_every_text_string_of_a_chat_request_and_keep_its_structure() -> None:
    request = chat_request()
    redacted = PATTERNS.redact_json(request)
    assert request == chat_request()  # the original is never changed (the client's answer is built from it)
    text = json.dumps(redacted)
    messages = redacted["messages"]
    assert messages[0] == {"role": "system", "content": "You help."}
    assert messages[1] == {
        "role": "user",
        "name": "alice",
        "content": [{"type": "text", "text": "I am [EMAIL]"}],
    }
    assert messages[2]["reasoning_content"] == "mail [EMAIL]"
    assert messages[2]["tool_calls"][0]["function"] == {"name": "send", "arguments": '{"to": "[EMAIL]"}'}
    assert messages[2]["tool_calls"][1]["function"] == {"name": "send", "arguments": {"name": "[EMAIL]"}}
    assert messages[2]["tool_calls"][0]["id"] == "call_1" and messages[3]["tool_call_id"] == "call_1"
    assert messages[3]["content"] == "sent to [EMAIL]"
    assert redacted["user"] == "[EMAIL]" and redacted["metadata"] == {"name": "[EMAIL]", "id": "7"}
    # Settings the client wrote are kept whole: tools, tool choice, stop strings.
    assert redacted["tools"] is request["tools"] and redacted["stop"] is request["stop"]
    assert text.count(EMAIL) == 2  # the tool description and the stop string
    assert redacted["model"] == "m" and redacted["temperature"] == 0.5


def test_all_replaces_every_text_string_with_the_placeholder() -> None:
    redacted = ALL.redact_json(chat_request())
    messages = redacted["messages"]
    assert messages[0] == {"role": "system", "content": "<gone>"}
    assert messages[1]["content"] == [{"type": "text", "text": "<gone>"}]
    assert messages[2]["content"] is None and messages[2]["reasoning_content"] == "<gone>"
    assert messages[2]["tool_calls"][0]["function"] == {"name": "send", "arguments": "<gone>"}
    assert redacted["tool_choice"] == "auto" and redacted["model"] == "m"
    assert ALL.redact_json({"messages": [{"role": "user", "content": ""}]})["messages"][0]["content"] == ""


def test_unchanged_json_comes_back_as_the_same_object() -> None:
    request = {"model": "m", "messages": [{"role": "user", "content": "Hi there."}], "n": 2}
    assert PATTERNS.redact_json(request) is request
    assert Redactor(PrivacyConfig()).redact_json(chat_request()) == chat_request()


def entry(token: str) -> dict[str, Any]:
    alternatives = [{"token": token.upper(), "logprob": -2.0, "bytes": list(token.upper().encode())}]
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": alternatives}


TOKENS = ["Mail", " al", "ice", ".smith@", "example", ".co", ".uk", " now", "."]


def test_chat_logprob_tokens_overlapping_redacted_text_are_masked() -> None:
    content = "".join(TOKENS)
    response = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "logprobs": {"content": [entry(t) for t in TOKENS], "refusal": None},
                "finish_reason": "stop",
                "token_ids": [5, 6, 7],
            }
        ],
    }
    redacted = PATTERNS.redact_json(response)
    choice = redacted["choices"][0]
    assert choice["message"]["content"] == "Mail [EMAIL] now."
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == ["Mail", "[EMAIL]", "", "", "", "", "", " now", "."]
    assert "".join(e["token"] for e in entries) == "Mail[EMAIL] now."
    assert [e["bytes"] is None for e in entries] == [False, *[True] * 6, False, False]
    assert entries[1]["top_logprobs"] == [{"token": "[EMAIL]", "logprob": -2.0, "bytes": None}]
    assert entries[0] == entry("Mail") and entries[1]["logprob"] == -0.5
    assert choice["token_ids"] == [5, 6, 7] and redacted["id"] == "chatcmpl-1"
    assert EMAIL not in json.dumps(redacted)
    assert all(
        e["token"] == "" or e["token"] == "<gone>"
        for e in ALL.redact_json(response)["choices"][0]["logprobs"]["content"]
    )


def test_legacy_and_responses_logprobs_are_masked_too() -> None:
    legacy = {
        "object": "text_completion",
        "choices": [
            {
                "text": "".join(TOKENS),
                "index": 0,
                "logprobs": {
                    "tokens": TOKENS,
                    "token_logprobs": [-0.5] * len(TOKENS),
                    "top_logprobs": [{t: -0.5} for t in TOKENS],
                    "text_offset": list(range(len(TOKENS))),
                },
            }
        ],
    }
    logprobs = PATTERNS.redact_json(legacy)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["Mail", "[EMAIL]", "", "", "", "", "", " now", "."]
    assert logprobs["top_logprobs"] == [{"Mail": -0.5}, *[None] * 6, {" now": -0.5}, {".": -0.5}]
    assert logprobs["text_offset"] == list(range(len(TOKENS)))

    part = {
        "type": "output_text",
        "text": "".join(TOKENS),
        "annotations": [],
        "logprobs": [entry(t) for t in TOKENS],
    }
    response = {
        "object": "response",
        "status": "completed",
        "output": [{"type": "message", "content": [part]}],
    }
    redacted = PATTERNS.redact_json(response)
    assert redacted["status"] == "completed"
    assert EMAIL not in json.dumps(redacted) and "ice" not in json.dumps(redacted["output"])
    assert PATTERNS.redact_json({"logprobs": True, "top_logprobs": 3}) == {
        "logprobs": True,
        "top_logprobs": 3,
    }


def test_responses_items_instructions_and_chat_view_are_redacted() -> None:
    request = {
        "model": "m",
        "instructions": f"Reply to {EMAIL}.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"I am {EMAIL}"}]},
            {"type": "function_call", "call_id": "c1", "name": "send", "arguments": f'{{"to": "{EMAIL}"}}'},
            {"type": "function_call_output", "call_id": "c1", "output": f"sent to {EMAIL}"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": EMAIL}]},
        ],
        "reasoning": {"effort": "low", "summary": "auto"},
        "text": {"format": {"type": "text"}},
        "chat_view": {
            "messages": [{"role": "user", "content": f"I am {EMAIL}"}],
            "tools": None,
            "answer": {"role": "assistant", "content": EMAIL},
        },
    }
    redacted = PATTERNS.redact_json(request)
    assert EMAIL not in json.dumps(redacted)
    assert redacted["input"][1] == {
        "type": "function_call",
        "call_id": "c1",
        "name": "send",
        "arguments": '{"to": "[EMAIL]"}',
    }
    assert (
        redacted["reasoning"] == {"effort": "low", "summary": "auto"} and redacted["text"] is request["text"]
    )
    assert redacted["chat_view"]["answer"] == {"role": "assistant", "content": "[EMAIL]"}
    assert PATTERNS.redact_json({"input": f"I am {EMAIL}"}) == {"input": "I am [EMAIL]"}


def record(cid: str, request: dict[str, Any], response: dict[str, Any], parent: str | None = None) -> Any:
    return dataclasses.replace(
        completion(cid, [1, 2], [3, 4], parent=parent), request_json=request, response_json=response
    )


def test_records_are_marked_only_when_redaction_changed_them() -> None:
    shared = {"messages": [{"role": "user", "content": f"I am {EMAIL}"}]}
    clean = {"messages": [{"role": "user", "content": "Hello."}]}
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi."}}]}
    records = [
        record("a", shared, answer),
        record("b", shared, answer),
        record("c", clean, answer),
        record("d", clean, {"choices": [{"index": 0, "message": {"role": "assistant", "content": EMAIL}}]}),
    ]
    stored = PATTERNS.records(records)
    assert [is_redacted(r.request_json) for r in stored] == [True, True, False, True]
    assert stored[0].request_json[REDACTED_MARK] == "patterns"
    assert stored[0].request_json["messages"] is stored[1].request_json["messages"]  # redacted once
    assert stored[2] is records[2]
    assert stored[3].request_json["messages"] == clean["messages"]
    assert all(
        s.prompt_ids is r.prompt_ids and s.output_ids is r.output_ids
        for s, r in zip(stored, records, strict=True)
    )
    assert records[0].request_json == {"messages": [{"role": "user", "content": f"I am {EMAIL}"}]}
    assert Redactor(PrivacyConfig()).records(records) == records
    assert ALL.records(records)[2].request_json[REDACTED_MARK] == "all"


def test_a_reloaded_tree_leaves_out_redacted_completions_and_their_descendants() -> None:
    marked = {REDACTED_MARK: "patterns"}
    records = [
        record("root", {}, {}),
        record("clean", {}, {}, parent="root"),
        record("red", marked, {}, parent="root"),
        record("under-red", {}, {}, parent="red"),
        record("deeper", {}, {}, parent="under-red"),
        record("other-root", marked, {}),
    ]
    assert [r.id for r in chainable(records)] == ["root", "clean"]
    assert [r.id for r in chainable(list(reversed(records)))] == ["clean", "root"]


def test_previous_response_id_refuses_a_redacted_response() -> None:
    refuse_redacted({"input": "hi"}, "resp_1")
    with pytest.raises(OpenAIError) as raised:
        refuse_redacted({"input": "[redacted]", REDACTED_MARK: "all"}, "resp_1")
    assert raised.value.status == 400 and raised.value.code == "response_redacted"
