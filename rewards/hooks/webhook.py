"""The `webhook` and `group_webhook` hooks: POST a finished session (or group), signed, to a URL of the
user's and take the reward it answers.

The request is the JSON of `rewards.hooks.wire` plus `"job_id"`, with the headers
- `X-Flywheel-Timestamp`: unix seconds when this try was sent;
- `X-Flywheel-Signature`: `sha256=<hex HMAC-SHA256 of f"{timestamp}.".encode() + body, keyed by the secret>`;
- `Idempotency-Key`: the job id, the same on every try and every re-run of the job.
A receiver checks the last two with `verify_signature` (or the same few lines in its own language).

Connection errors, timeouts, 408, 429 and 5xx are retried with a doubling backoff (a 429's or 503's
Retry-After is honoured); any other status fails at once. The answer:
- session level: `{"reward": number | null, "completions": {completion_id: number}?, "details": {...}?}`;
- group level: `{"sessions": {session_id: <a session-level answer> | null}}`.
A null reward without completion rewards is no opinion (None).
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import hmac
import json
import logging
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rewards.hooks.contract import (
    GroupInput,
    GroupResult,
    HookContext,
    HookFactory,
    HookLevel,
    HookResult,
    SessionInput,
)
from rewards.hooks.wire import group_json, session_json

logger = logging.getLogger(__name__)

USER_AGENT = "flywheel-reward-hook"
MAX_BACKOFF_S = 30.0
"""The longest backoff between two tries (a Retry-After may ask for longer, within the job's limit)."""
MAX_ANSWER_BYTES = 4 * 1024 * 1024
BODY_TAIL_CHARS = 500
"""How much of a failed answer's body a WebhookError keeps (its end)."""

_RESERVED_HEADERS = frozenset(
    {"content-type", "content-length", "transfer-encoding", "host", "user-agent"}
    | {"x-flywheel-timestamp", "x-flywheel-signature", "idempotency-key"}
)
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")
_TIMESTAMP = re.compile(r"[0-9]{1,15}")
_DELTA_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]+)?")

Sleep = Callable[[float], Awaitable[None]]


class WebhookError(RuntimeError):
    """The webhook failed: a refusal, retries run out, or an answer that is not a reward.
    `status` is the last HTTP status (None when no answer came), `body_tail` the end of its body."""

    def __init__(self, message: str, *, status: int | None = None, body_tail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body_tail = body_tail


class WebhookArgs(BaseModel):
    """Where to send sessions, how to sign them, and how hard to try."""

    model_config = ConfigDict(extra="forbid")

    url: str
    """An http:// or https:// URL."""
    secret: str | None = Field(default=None, min_length=1, repr=False)
    """The signing secret itself; or give `secret_env`."""
    secret_env: str | None = Field(default=None, min_length=1)
    """The name of an environment variable holding the signing secret (read when the hook is built)."""
    timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    """The limit of one request, connection to the answer's last byte."""
    max_attempts: int = Field(default=5, ge=1)
    """Tries within one run of the job."""
    backoff_s: float = Field(default=0.5, ge=0, allow_inf_nan=False)
    """The delay before the first retry; it doubles on each next one, up to MAX_BACKOFF_S."""
    headers: dict[str, str] = Field(default_factory=dict)
    """More request headers (e.g. Authorization); the ones the hook sets itself are refused."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        try:
            httpx.URL(url)
        except httpx.InvalidURL as error:
            raise ValueError(f"is not a valid URL: {error}") from error
        return url

    @field_validator("headers")
    @classmethod
    def _extra_headers(cls, headers: dict[str, str]) -> dict[str, str]:
        for name, value in headers.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid header name")
            if name.lower() in _RESERVED_HEADERS:
                raise ValueError(f"{name!r} is set by the webhook itself")
            if not _HEADER_VALUE.fullmatch(value):
                raise ValueError(f"header {name!r}: values are printable ASCII")
        return headers

    @model_validator(mode="after")
    def _one_secret(self) -> WebhookArgs:
        if (self.secret is None) == (self.secret_env is None):
            raise ValueError("give exactly one of `secret` and `secret_env`")
        return self


def resolve_secret(args: WebhookArgs) -> bytes:
    """The signing secret: `args.secret`, or the value of the environment variable `args.secret_env`
    (ValueError naming it when it is unset or empty)."""
    if args.secret is not None:
        return args.secret.encode()
    value = os.environ.get(args.secret_env or "")
    if not value:
        raise ValueError(f"webhook: the environment variable {args.secret_env!r} (secret_env) is not set")
    return value.encode()


def sign(secret: str | bytes, timestamp: int | str, body: bytes) -> str:
    """The `X-Flywheel-Signature` value of `body` sent at `timestamp`: `sha256=<hex HMAC-SHA256>` over
    `f"{timestamp}.".encode() + body`."""
    key = secret.encode() if isinstance(secret, str) else secret
    digest = hmac.new(key, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def verify_signature(
    secret: str | bytes,
    body: bytes,
    timestamp_header: str | None,
    signature_header: str | None,
    *,
    tolerance_s: float = 300,
    now: float | None = None,
) -> bool:
    """Whether a request is the webhook's: its signature matches `body` and its timestamp (constant-time
    compare), and the timestamp is within `tolerance_s` of `now` (default: the clock), so a replayed old
    request is refused."""
    if timestamp_header is None or signature_header is None:
        return False
    timestamp = timestamp_header.strip()
    if not _TIMESTAMP.fullmatch(timestamp):
        return False
    current = time.time() if now is None else now
    if abs(current - int(timestamp)) > tolerance_s:
        return False
    expected = sign(secret, timestamp, body).encode()
    return hmac.compare_digest(expected, signature_header.strip().encode())


def parse_retry_after(value: str | None, now: float) -> float | None:
    """The delay a Retry-After header asks for, in seconds (delta-seconds or an HTTP date); None when
    absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if _DELTA_SECONDS.fullmatch(value):
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


def retry_delay(retry: int, backoff_s: float, retry_after: float | None) -> float:
    """The wait before retry number `retry` (1 for the first): what Retry-After asked for, else
    `backoff_s` doubling on each retry, capped at MAX_BACKOFF_S."""
    if retry_after is not None:
        return retry_after
    return min(backoff_s * 2.0 ** min(retry - 1, 64), MAX_BACKOFF_S)


def is_retryable(status: int) -> bool:
    """Whether an HTTP status is worth another try: 408, 429 and 5xx."""
    return status in (408, 429) or 500 <= status < 600


def encode_body(payload: Mapping[str, Any]) -> bytes:
    """The request body: compact UTF-8 JSON (WebhookError when the subject cannot be JSON)."""
    try:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as error:
        raise WebhookError(f"the subject cannot be sent as JSON: {error}") from error


def _clip(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise WebhookError(f"{what} is not a number: {_clip(repr(value))}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise WebhookError(f"{what} is not a finite number: {_clip(repr(value))}")
    return number


def _load_json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, RecursionError) as error:
        raise WebhookError(f"the answer is not JSON ({error})", body_tail=_tail(content)) from error


def _tail(content: bytes) -> str:
    return content.decode(errors="replace")[-BODY_TAIL_CHARS:]


def _session_result(entry: Any, subject: SessionInput, where: str) -> HookResult:
    """One session's labels from its answer (`where` names it in errors)."""
    if not isinstance(entry, dict):
        raise WebhookError(f"{where} is not a JSON object: {_clip(repr(entry))}")
    if "reward" not in entry:
        raise WebhookError(f'{where} has no "reward" (null for no opinion)')
    reward = None if entry["reward"] is None else _finite(entry["reward"], f"{where}'s reward")
    raw_completions = entry.get("completions")
    raw_completions = {} if raw_completions is None else raw_completions
    if not isinstance(raw_completions, dict):
        raise WebhookError(f"{where}'s completions are not an object of completion id to reward")
    known = {completion.id for completion in subject.completions}
    completions: dict[str, float] = {}
    for completion_id, value in raw_completions.items():
        if completion_id not in known:
            raise WebhookError(
                f"{where} rewards completion {_clip(completion_id)!r}, not one of session "
                f"{subject.session_id!r}"
            )
        completions[completion_id] = _finite(value, f"{where}'s reward of completion {completion_id!r}")
    details = {} if entry.get("details") is None else entry["details"]
    if not isinstance(details, dict):
        raise WebhookError(f"{where}'s details are not a JSON object")
    return HookResult(session=reward, completions=completions, details=details)


def parse_session_answer(content: bytes, subject: SessionInput) -> HookResult | None:
    """A session webhook's answer as a HookResult; None for no opinion; WebhookError when malformed."""
    result = _session_result(_load_json(content), subject, "the answer")
    return None if result.empty else result


def parse_group_answer(content: bytes, subject: GroupInput) -> GroupResult | None:
    """A group webhook's answer as a GroupResult (sessions without an opinion left out); None when it has
    no opinion on any; WebhookError when malformed or naming a session not in the group."""
    answer = _load_json(content)
    if not isinstance(answer, dict) or not isinstance(answer.get("sessions"), dict):
        raise WebhookError('the answer is not {"sessions": {session_id: {...}}}')
    sessions = {session.session_id: session for session in subject.sessions}
    results: dict[str, HookResult] = {}
    for session_id, entry in answer["sessions"].items():
        session = sessions.get(session_id)
        if session is None:
            raise WebhookError(
                f"the answer names session {_clip(session_id)!r}, not in group {subject.group_id!r}"
            )
        if entry is None:
            continue
        result = _session_result(entry, session, f"session {session_id!r}")
        if not result.empty:
            results[session_id] = result
    return GroupResult(sessions=results) if results else None


def _redacted(url: str) -> str:
    """`url` for messages: without credentials, query or fragment."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


@dataclass(frozen=True, slots=True)
class _Retry:
    """A try that is worth repeating, and why."""

    reason: str
    retry_after: float | None = None
    status: int | None = None
    body_tail: str = ""


async def _read_bounded(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the answer, and whether that is all of it."""
    content = bytearray()
    async for chunk in response.aiter_bytes():
        content += chunk
        if len(content) > limit:
            return bytes(content[:limit]), False
    return bytes(content), True


class Webhook:
    """The webhook hook at either level: `level` "session" POSTs one session, "group" a whole group."""

    level: HookLevel = "session"

    def __init__(self, args: WebhookArgs, level: HookLevel = "session", *, sleep: Sleep = asyncio.sleep):
        self.level = level
        self._args = args
        self._secret = resolve_secret(args)
        self._where = _redacted(args.url)
        self._sleep = sleep

    async def __call__(
        self, subject: SessionInput | GroupInput, context: HookContext
    ) -> HookResult | GroupResult | None:
        """POST the subject (retrying what is worth it) and read its reward from the answer."""
        if self.level == "group":
            if not isinstance(subject, GroupInput):
                raise TypeError(f"group_webhook labels a GroupInput, not {type(subject).__name__}")
            payload = group_json(subject)
        elif isinstance(subject, SessionInput):
            payload = session_json(subject)
        else:
            raise TypeError(f"webhook labels a SessionInput, not {type(subject).__name__}")
        content = await self._post(encode_body({**payload, "job_id": context.job_id}), context)
        if isinstance(subject, GroupInput):
            return parse_group_answer(content, subject)
        return parse_session_answer(content, subject)

    async def _post(self, body: bytes, context: HookContext) -> bytes:
        """The 2xx answer's body, after as many tries as `max_attempts` and the job's limit allow."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + context.timeout_s
        attempts = self._args.max_attempts
        attempt = 1
        outcome = await self._try(body, context)
        while isinstance(outcome, _Retry):
            if attempt == attempts:
                raise WebhookError(
                    f"webhook {self._where}: {outcome.reason}, after {attempts} tries",
                    status=outcome.status,
                    body_tail=outcome.body_tail,
                )
            delay = retry_delay(attempt, self._args.backoff_s, outcome.retry_after)
            if loop.time() + delay >= deadline:
                raise WebhookError(
                    f"webhook {self._where}: {outcome.reason}; the next try, in {delay:g} s, would pass the "
                    "job's limit",
                    status=outcome.status,
                    body_tail=outcome.body_tail,
                )
            attempt += 1
            logger.info(
                "webhook %s (job %s): %s; try %d of %d in %g s",
                self._where, context.job_id, outcome.reason, attempt, attempts, delay,
            )
            await self._sleep(delay)
            outcome = await self._try(body, context)
        return outcome

    async def _try(self, body: bytes, context: HookContext) -> bytes | _Retry:
        """One signed POST: the 2xx body, a _Retry, or WebhookError for what retrying will not fix."""
        timestamp = str(int(time.time()))
        headers = {
            **self._args.headers,
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            "X-Flywheel-Timestamp": timestamp,
            "X-Flywheel-Signature": sign(self._secret, timestamp, body),
            "Idempotency-Key": context.job_id,
        }
        timeout_s = self._args.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async with context.http.stream(
                    "POST", self._args.url, content=body, headers=headers, timeout=timeout_s
                ) as response:
                    status: int = response.status_code
                    retry_after = response.headers.get("Retry-After")
                    content, complete = await _read_bounded(response, MAX_ANSWER_BYTES)
        except TimeoutError:
            return _Retry(f"no answer within {timeout_s:g} s")
        except httpx.TransportError as error:
            return _Retry(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        except httpx.HTTPError as error:
            raise WebhookError(f"webhook {self._where}: {type(error).__name__}: {error}") from error
        if 200 <= status < 300:
            if not complete:
                raise WebhookError(f"webhook {self._where}: the answer is over {MAX_ANSWER_BYTES} bytes")
            return content
        tail = _tail(content)
        if is_retryable(status):
            wait = parse_retry_after(retry_after, time.time()) if status in (429, 503) else None
            return _Retry(f"HTTP {status}", retry_after=wait, status=status, body_tail=tail)
        message = f"webhook {self._where}: HTTP {status}: {_clip(tail, 200)}"
        raise WebhookError(message, status=status, body_tail=tail)


FACTORIES: tuple[HookFactory, ...] = (
    HookFactory(
        name="webhook",
        level="session",
        args=WebhookArgs,
        build=partial(Webhook, level="session"),
        summary="POST each finished session, signed, to a URL and take the reward it answers",
    ),
    HookFactory(
        name="group_webhook",
        level="group",
        args=WebhookArgs,
        build=partial(Webhook, level="group"),
        summary="POST each finished group, signed, to a URL and take the rewards it answers per session",
    ),
)
