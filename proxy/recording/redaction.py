"""Redaction of the request and response JSON the proxy stores (`proxy.privacy.redact`, docs/privacy.md),
applied to a call's completion records before they are written: the database never sees the text
redaction removes, while the client's answer and the conversation index keep it.

Every string that carries user or model text is redacted: message content and text parts, reasoning,
tool-call arguments, legacy prompts and outputs, Responses input and output items, instructions,
metadata. Kept as they are: the strings under the keys that name things (`KEEP_STRINGS`: ids, model,
roles, types, function names, statuses, finish reasons), whole settings the client wrote (`KEEP_WHOLE`:
tool definitions, tool choice, response formats, stop strings), every number, and object keys; inside
free-form JSON (tool-call arguments, metadata) every string is redacted whatever its key. The
token strings of logprobs are masked where they overlap redacted text (in `all` mode, all of them),
their `bytes` nulled. A record whose JSON changed is marked (`proxy.privacy.REDACTED_MARK`)."""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.errors import OpenAIError
from proxy.privacy import DETECTORS, REDACTED_MARK, PrivacyConfig, is_redacted
from proxy.workers.plan import CONSTRAINT_MARK
from storage.records import CompletionRecord

KEEP_STRINGS = frozenset(
    {
        "id",
        "object",
        "model",
        "role",
        "type",
        "name",
        "status",
        "finish_reason",
        "call_id",
        "tool_call_id",
        "previous_response_id",
        "completion_id",
        "service_tier",
        "system_fingerprint",
        "truncation",
        "effort",
        "reasoning_effort",
        "reason",
        "summary",
    }
)
"""Keys whose string values name or classify something (never free text): kept. (`summary` only as a
string, the setting `reasoning.summary`; a reasoning item's summary parts are redacted.)"""
KEEP_WHOLE = frozenset(
    {
        "tools",
        "tool_choice",
        "response_format",
        "format",
        "logit_bias",
        "stop",
        "include",
        REDACTED_MARK,
        CONSTRAINT_MARK,
    }
)
"""Keys whose values are settings the client wrote (tool definitions, formats, stop strings): kept."""
FREE_FORM = frozenset({"arguments", "metadata"})
"""Keys whose values are JSON of the client's or the model's own making (tool-call arguments given as
objects, metadata): every string in them is text, whatever key it is under."""
LOGPROBS = "logprobs"

Span = tuple[int, int, str]
"""(start, end, replacement) of redacted text."""
Rule = tuple[re.Pattern[str], str, Callable[[str], bool] | None]

_CHARS_PER_TOKEN = 4  # to tell a large call from its token counts without measuring its JSON


class Redactor:
    """Redacts stored JSON as `proxy.privacy` says; `in_thread_chars`: redact calls of about more
    characters than this in a worker thread (proxy.tokenize_in_thread_chars)."""

    def __init__(self, config: PrivacyConfig, in_thread_chars: int = 8192) -> None:
        self.mode = config.redact
        self.placeholder = config.placeholder
        self._in_thread_chars = in_thread_chars
        self._rules: list[Rule] = [
            (pattern.compiled(), pattern.replacement, None) for pattern in config.patterns
        ]
        for name in config.detectors:
            detector = DETECTORS[name]
            self._rules.append((detector.regex, detector.replacement, detector.accept))

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def spans(self, text: str) -> list[Span]:
        """The parts of `text` to replace, in order, overlapping matches merged (the earlier-starting one's
        replacement, or on a tie the first rule's)."""
        if self.mode == "none" or not text:
            return []
        if self.mode == "all":
            return [(0, len(text), self.placeholder)]
        found: list[tuple[int, int, int, str]] = []
        for priority, (regex, replacement, accept) in enumerate(self._rules):
            for match in regex.finditer(text):
                if match.end() > match.start() and (accept is None or accept(match.group())):
                    found.append((match.start(), match.end(), priority, replacement))
        found.sort(key=lambda match: (match[0], match[2]))
        merged: list[Span] = []
        for start, end, _priority, replacement in found:
            if merged and start < merged[-1][1]:
                last = merged[-1]
                merged[-1] = (last[0], max(last[1], end), last[2])
            else:
                merged.append((start, end, replacement))
        return merged

    def text(self, text: str) -> str:
        """`text` redacted (the same object when nothing in it is)."""
        spans = self.spans(text)
        if not spans:
            return text
        parts: list[str] = []
        done = 0
        for start, end, replacement in spans:
            parts += [text[done:start], replacement]
            done = end
        parts.append(text[done:])
        redacted = "".join(parts)
        return text if redacted == text else redacted

    def redact_json(self, value: Any, key: str | None = None, free: bool = False) -> Any:
        """Decoded JSON with its text redacted; the same object when nothing in it changed (so a caller
        tells a changed record by identity). `key`: the object key `value` is found under; `free`: inside
        free-form JSON (`FREE_FORM`), where every string is text whatever its key."""
        if isinstance(value, str):
            return value if key in KEEP_STRINGS and not free else self.text(value)
        if isinstance(value, dict):
            changed: dict[str, Any] | None = None
            for name, item in value.items():
                if free:
                    new = self.redact_json(item, name, True)
                elif name in KEEP_WHOLE:
                    continue
                elif name == LOGPROBS:
                    new = self._logprobs(item)
                else:
                    new = self.redact_json(item, name, name in FREE_FORM)
                if new is not item:
                    changed = changed if changed is not None else dict(value)
                    changed[name] = new
            return value if changed is None else changed
        if isinstance(value, list):
            items = [self.redact_json(item, None, free) for item in value]  # a key names no list's strings
            return value if all(new is old for new, old in zip(items, value, strict=True)) else items
        return value

    def _logprobs(self, value: Any) -> Any:
        """A `logprobs` field: chat's `{content: [...], refusal: [...]}`, a Responses text part's list of
        entries, legacy completions' `{tokens, top_logprobs, ...}`; a request's number or flag as it is."""
        if isinstance(value, list):
            return self._entries(value)
        if not isinstance(value, dict):
            return value
        if isinstance(value.get("tokens"), list):
            return self._legacy(value)
        changed = {
            name: self._entries(item) if isinstance(item, list) else item for name, item in value.items()
        }
        return value if all(changed[name] is item for name, item in value.items()) else changed

    def _entries(self, entries: list[Any]) -> list[Any]:
        """Logprob entries `{token, logprob, bytes, top_logprobs}`: those overlapping redacted text get the
        replacement (the first of a span) or "" (the rest) as their token, and null bytes; so do their
        alternatives."""
        tokens = [_token(entry.get("token")) if isinstance(entry, dict) else "" for entry in entries]
        marks = self.token_marks(tokens)
        if not marks:
            return entries
        masked = list(entries)
        for position, mark in marks.items():
            entry = entries[position]
            if not isinstance(entry, dict):
                continue
            new = {**entry, "token": mark, "bytes": None}
            if isinstance(entry.get("top_logprobs"), list):
                new["top_logprobs"] = [
                    {**alternative, "token": mark, "bytes": None}
                    if isinstance(alternative, dict)
                    else alternative
                    for alternative in entry["top_logprobs"]
                ]
            masked[position] = new
        return masked

    def _legacy(self, logprobs: dict[str, Any]) -> dict[str, Any]:
        """Legacy completions' logprobs: masked tokens as in `_entries`; their `top_logprobs` (keyed by
        token text) become null."""
        tokens = logprobs["tokens"]
        marks = self.token_marks([_token(token) for token in tokens])
        if not marks:
            return logprobs
        masked = {**logprobs, "tokens": [marks.get(i, token) for i, token in enumerate(tokens)]}
        top = logprobs.get("top_logprobs")
        if isinstance(top, list):
            masked["top_logprobs"] = [None if i in marks else item for i, item in enumerate(top)]
        return masked

    def token_marks(self, tokens: Sequence[str]) -> dict[int, str]:
        """Which tokens of a generated sequence overlap redacted text, and what each shows instead: the
        span's replacement for its first token, "" for the others."""
        spans = self.spans("".join(tokens))
        if not spans:
            return {}
        ends = list(itertools.accumulate(len(token) for token in tokens))
        marks: dict[int, str] = {}
        for start, end, replacement in spans:
            position = bisect.bisect_right(ends, start)  # the first token ending after the span starts
            first = True
            while position < len(tokens) and ends[position] - len(tokens[position]) < end:
                marks.setdefault(position, replacement if first else "")
                first = False
                position += 1
        return marks

    def records(self, records: Sequence[CompletionRecord]) -> list[CompletionRecord]:
        """The records as they are stored: JSON redacted, marked where it changed (records sharing one
        request object, a call's choices, redact it once). Token ids are never touched."""
        if not self.active:
            return list(records)
        requests: dict[int, dict[str, Any]] = {}
        stored: list[CompletionRecord] = []
        for record in records:
            request = requests.get(id(record.request_json))
            if request is None:
                request = requests[id(record.request_json)] = self.redact_json(record.request_json)
            response = self.redact_json(record.response_json)
            if request is record.request_json and response is record.response_json:
                stored.append(record)
                continue
            stored.append(
                dataclasses.replace(
                    record, request_json={**request, REDACTED_MARK: self.mode}, response_json=response
                )
            )
        return stored

    async def records_async(self, records: Sequence[CompletionRecord], tokens: int) -> list[CompletionRecord]:
        """`records(records)`, in a worker thread for a call of `tokens` prompt and output tokens that is
        larger than `in_thread_chars` (about four characters a token)."""
        if not self.active:
            return list(records)
        if tokens * _CHARS_PER_TOKEN > self._in_thread_chars:
            return await asyncio.to_thread(self.records, records)
        return self.records(records)


def _token(value: Any) -> str:
    return value if isinstance(value, str) else ""


def refuse_redacted(request_json: Mapping[str, Any], response_id: str) -> None:
    """A 400 for a stored response whose JSON was redacted: its earlier turns cannot be rebuilt from it
    (`previous_response_id`) without silently putting redacted text in the model's prompt."""
    if is_redacted(request_json):
        raise OpenAIError(
            400,
            f"Response '{response_id}' was stored redacted (proxy.privacy.redact), so its turns cannot "
            "be rebuilt: send the conversation's items in `input` instead of previous_response_id.",
            "invalid_request_error",
            param="previous_response_id",
            code="response_redacted",
        )
