"""The webhook hooks against a real HTTP receiver on 127.0.0.1: signed requests, retries, refusals and
answers."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web
from pydantic import ValidationError

from rewards.hooks.contract import (
    CompletionView,
    GroupInput,
    GroupResult,
    Hook,
    HookContext,
    HookResult,
    SessionInput,
)
from rewards.hooks.webhook import (
    FACTORIES,
    Webhook,
    WebhookArgs,
    WebhookError,
    parse_retry_after,
    retry_delay,
    sign,
    verify_signature,
)
from rewards.hooks.wire import group_json, session_json
from tests.support.hook_inputs import NoPool, completion_view, hook_context

SECRET = "receiver-secret"
QUESTION = ({"role": "user", "content": "What is 6 * 7?"},)
HANG = "hang"


@dataclass(frozen=True)
class Reply:
    """What the receiver answers: a status, a body, headers; or HANG (no answer until it closes)."""

    status: int = 200
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)


def ok(answer: Any) -> Reply:
    return Reply(200, json.dumps(answer))


@dataclass(frozen=True)
class Seen:
    body: bytes
    headers: dict[str, str]
    valid: bool


class Receiver:
    """A webhook receiver: checks each request's signature with verify_signature (401 when wrong), records
    it, and answers its scripted replies in order (the last one repeats)."""

    def __init__(self, replies: list[Reply | str], secret: str = SECRET) -> None:
        self.replies = replies
        self.secret = secret
        self.seen: list[Seen] = []
        self.url = ""
        self._release = asyncio.Event()
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = dict(request.headers)
        valid = verify_signature(
            self.secret, body, headers.get("X-Flywheel-Timestamp"), headers.get("X-Flywheel-Signature")
        )
        self.seen.append(Seen(body, headers, valid))
        if not valid:
            return web.Response(status=401, text="bad signature")
        reply = self.replies[min(len(self.seen), len(self.replies)) - 1]
        if reply == HANG:
            await self._release.wait()
            return web.Response(status=500, text="too late")
        assert isinstance(reply, Reply)
        return web.Response(status=reply.status, text=reply.body, headers=reply.headers)

    async def __aenter__(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}/hook"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._release.set()
        assert self._runner is not None
        await self._runner.cleanup()

    def bodies(self) -> list[Any]:
        return [json.loads(seen.body) for seen in self.seen]


class Naps:
    """A sleep that records the delays it was asked for instead of waiting them out."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0)


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


def context(http: httpx.AsyncClient, *, attempt: int = 1, timeout_s: float = 60.0) -> HookContext:
    return hook_context(http, NoPool("the webhook"), job_id="job-7", attempt=attempt, timeout_s=timeout_s)


def completion(id: str, text: str, parent_id: str | None = None) -> CompletionView:
    return completion_view(id, text, parent_id=parent_id, messages=QUESTION)


def session(session_id: str = "s1") -> SessionInput:
    return SessionInput(
        session_id=session_id,
        group_id="g1",
        task={"question": "What is 6 * 7?"},
        metadata={"answer": "42"},
        completions=(completion("c1", "Let me think."), completion("c2", "42", parent_id="c1")),
    )


def group() -> GroupInput:
    sessions = (session("s1"), session("s2"))
    return GroupInput(group_id="g1", task={"question": "What is 6 * 7?"}, sessions=sessions)


def args(url: str, **overrides: Any) -> WebhookArgs:
    return WebhookArgs(url=url, secret=SECRET, **{"backoff_s": 0.01, **overrides})


async def run(hook: Hook, subject: SessionInput | GroupInput, ctx: HookContext) -> Any:
    return await asyncio.wait_for(hook(subject, ctx), timeout=30)


async def test_retries_503_and_returns_the_reward_with_one_idempotency_key(http: httpx.AsyncClient):
    replies: list[Reply | str] = [Reply(503), Reply(503), ok({"reward": 0.75, "details": {"why": "right"}})]
    webhook_factory = next(factory for factory in FACTORIES if factory.name == "webhook")
    async with Receiver(replies) as receiver:
        hook = webhook_factory.build(args(receiver.url, headers={"Authorization": "Bearer t"}))
        result = await run(hook, session(), context(http))
        rerun = await run(hook, session(), context(http, attempt=2))
    assert result == HookResult(session=0.75, details={"why": "right"})
    assert rerun == result
    assert len(receiver.seen) == 4
    assert all(seen.valid for seen in receiver.seen)
    assert {seen.headers["Idempotency-Key"] for seen in receiver.seen} == {"job-7"}
    assert receiver.bodies() == [{**session_json(session()), "job_id": "job-7"}] * 4
    headers = receiver.seen[0].headers
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"] == "flywheel-reward-hook"
    assert headers["Authorization"] == "Bearer t"


async def test_completion_rewards_and_no_opinion(http: httpx.AsyncClient):
    replies: list[Reply | str] = [ok({"reward": None, "completions": {"c2": 1}}), ok({"reward": None})]
    async with Receiver(replies) as receiver:
        hook = Webhook(args(receiver.url))
        per_completion = await run(hook, session(), context(http))
        no_opinion = await run(hook, session(), context(http))
    assert per_completion == HookResult(session=None, completions={"c2": 1.0})
    assert no_opinion is None


async def test_a_400_fails_at_once(http: httpx.AsyncClient):
    naps = Naps()
    async with Receiver([Reply(400, "x" * 5000 + "unknown task")]) as receiver:
        with pytest.raises(WebhookError) as caught:
            await run(Webhook(args(receiver.url), sleep=naps), session(), context(http))
    assert caught.value.status == 400
    assert caught.value.body_tail.endswith("unknown task")
    assert len(caught.value.body_tail) <= 500
    assert len(receiver.seen) == 1
    assert naps.delays == []


async def test_retry_after_is_honoured_and_backoff_doubles(http: httpx.AsyncClient):
    replies: list[Reply | str] = [
        Reply(429, headers={"Retry-After": "7"}),
        Reply(503, headers={"Retry-After": "3"}),
        Reply(500, headers={"Retry-After": "9"}),
        Reply(408),
        ok({"reward": 1}),
    ]
    naps = Naps()
    async with Receiver(replies) as receiver:
        result = await run(Webhook(args(receiver.url, backoff_s=0.5), sleep=naps), session(), context(http))
    assert result == HookResult(session=1.0)
    assert naps.delays == [7.0, 3.0, 2.0, 4.0]
    assert len(receiver.seen) == 5


async def test_a_retry_after_past_the_job_limit_fails_now(http: httpx.AsyncClient):
    naps = Naps()
    async with Receiver([Reply(429, headers={"Retry-After": "120"})]) as receiver:
        with pytest.raises(WebhookError, match="job's limit") as caught:
            await run(Webhook(args(receiver.url), sleep=naps), session(), context(http, timeout_s=60))
    assert caught.value.status == 429
    assert len(receiver.seen) == 1
    assert naps.delays == []


async def test_connection_refused_is_retried_then_fails(http: httpx.AsyncClient):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    naps = Naps()
    hook = Webhook(args(f"http://127.0.0.1:{port}/hook", max_attempts=3, backoff_s=0.5), sleep=naps)
    with pytest.raises(WebhookError, match=r"ConnectError.*after 3 tries") as caught:
        await run(hook, session(), context(http))
    assert caught.value.status is None
    assert naps.delays == [0.5, 1.0]


async def test_a_request_past_its_timeout_is_retried(http: httpx.AsyncClient):
    async with Receiver([HANG, ok({"reward": 0.5})]) as receiver:
        result = await run(Webhook(args(receiver.url, timeout_s=1.0)), session(), context(http))
    assert result == HookResult(session=0.5)
    assert len(receiver.seen) == 2


async def test_a_receiver_with_another_secret_refuses_with_401(http: httpx.AsyncClient):
    async with Receiver([ok({"reward": 1})], secret="another-secret") as receiver:
        with pytest.raises(WebhookError) as caught:
            await run(Webhook(args(receiver.url)), session(), context(http))
    assert caught.value.status == 401
    assert [seen.valid for seen in receiver.seen] == [False]


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        "[1]",
        '{"score": 1}',
        '{"reward": "1"}',
        '{"reward": true}',
        '{"reward": NaN}',
        '{"reward": 1e999}',
        '{"reward": 1, "completions": {"c9": 1}}',
        '{"reward": 1, "completions": [1]}',
        '{"reward": null, "completions": {"c1": Infinity}}',
        '{"reward": 1, "details": "why"}',
    ],
)
async def test_a_malformed_answer_raises(http: httpx.AsyncClient, body: str):
    async with Receiver([Reply(200, body)]) as receiver:
        with pytest.raises(WebhookError):
            await run(Webhook(args(receiver.url)), session(), context(http))
    assert len(receiver.seen) == 1


async def test_the_group_webhook_labels_sessions(http: httpx.AsyncClient):
    answer = {"sessions": {"s1": {"reward": 1, "completions": {"c1": 0.5}}, "s2": {"reward": None}}}
    group_factory = next(factory for factory in FACTORIES if factory.name == "group_webhook")
    async with Receiver([ok(answer)]) as receiver:
        hook = group_factory.build(args(receiver.url))
        result = await run(hook, group(), context(http))
    assert hook.level == "group"
    assert result == GroupResult(sessions={"s1": HookResult(session=1.0, completions={"c1": 0.5})})
    assert receiver.bodies() == [{**group_json(group()), "job_id": "job-7"}]
    assert [s["session_id"] for s in receiver.bodies()[0]["sessions"]] == ["s1", "s2"]


@pytest.mark.parametrize(
    "answer",
    [{"sessions": {"s3": {"reward": 1}}}, {"reward": 1}, {"sessions": {"s1": {"reward": "high"}}}],
)
async def test_a_malformed_group_answer_raises(http: httpx.AsyncClient, answer: Any):
    async with Receiver([ok(answer)]) as receiver:
        with pytest.raises(WebhookError):
            await run(Webhook(args(receiver.url), "group"), group(), context(http))


async def test_a_hook_refuses_the_other_level(http: httpx.AsyncClient):
    with pytest.raises(TypeError):
        await Webhook(args("http://127.0.0.1:9/hook"), "group")(session(), context(http))
    with pytest.raises(TypeError):
        await Webhook(args("http://127.0.0.1:9/hook"))(group(), context(http))


def test_the_signature_is_hmac_sha256_over_timestamp_dot_body():
    expected = hmac.new(b"k", b"1700000000.{}", hashlib.sha256).hexdigest()
    assert sign("k", 1700000000, b"{}") == f"sha256={expected}"
    assert sign(b"k", "1700000000", b"{}") == f"sha256={expected}"


def test_verify_signature_refuses_tampering_and_stale_timestamps():
    body = b'{"session_id":"s1"}'
    signature = sign("k", 1_700_000_000, body)
    assert verify_signature("k", body, "1700000000", signature, now=1_700_000_100)
    assert not verify_signature("k", body + b" ", "1700000000", signature, now=1_700_000_100)
    assert not verify_signature("k2", body, "1700000000", signature, now=1_700_000_100)
    assert not verify_signature("k", body, "1700000001", signature, now=1_700_000_100)
    assert not verify_signature("k", body, "1700000000", signature, now=1_700_000_301)
    assert not verify_signature("k", body, "1700000000", signature, now=1_699_999_699)
    assert verify_signature("k", body, "1700000000", signature, tolerance_s=1000, now=1_700_000_301)
    assert not verify_signature("k", body, None, signature, now=1_700_000_100)
    assert not verify_signature("k", body, "1700000000", None, now=1_700_000_100)
    assert not verify_signature("k", body, "soon", signature, now=1_700_000_100)
    assert not verify_signature("k", body, "1700000000", "sha256=ü", now=1_700_000_100)


def test_retry_delays():
    assert [retry_delay(n, 0.5, None) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    assert retry_delay(10_000, 0.5, None) == 30
    assert retry_delay(1, 0.5, 45.0) == 45.0
    assert parse_retry_after(" 12 ", now=0) == 12.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:00 GMT", now=20) == 40.0
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:00 GMT", now=100) == 0.0
    assert parse_retry_after("later", now=0) is None
    assert parse_retry_after(None, now=0) is None


@pytest.mark.parametrize(
    "fields",
    [
        {"url": "ftp://example.com/hook", "secret": "s"},
        {"url": "example.com/hook", "secret": "s"},
        {"url": "http:///hook", "secret": "s"},
        {"url": "https://example.com/hook"},
        {"url": "https://example.com/hook", "secret": "s", "secret_env": "S"},
        {"url": "https://example.com/hook", "secret": ""},
        {"url": "https://example.com/hook", "secret": "s", "retries": 3},
        {"url": "https://example.com/hook", "secret": "s", "max_attempts": 0},
        {"url": "https://example.com/hook", "secret": "s", "timeout_s": 0},
        {"url": "https://example.com/hook", "secret": "s", "headers": {"x-flywheel-signature": "v"}},
        {"url": "https://example.com/hook", "secret": "s", "headers": {"X-A": "a\r\nX-B: b"}},
        {"url": "https://example.com/hook", "secret": "s", "headers": {"X A": "a"}},
    ],
)
def test_invalid_args_are_refused(fields: dict[str, Any]):
    with pytest.raises(ValidationError):
        WebhookArgs.model_validate(fields)


def test_the_secret_stays_out_of_the_args_repr():
    assert "hunter2" not in repr(WebhookArgs(url="https://example.com/hook", secret="hunter2"))


async def test_secret_env_is_read_at_build(http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch):
    name = "FLYWHEEL_TEST_WEBHOOK_SECRET"
    monkeypatch.delenv(name, raising=False)
    env_args = WebhookArgs(url="http://127.0.0.1:9/hook", secret_env=name)
    with pytest.raises(ValueError, match=name):
        FACTORIES[0].build(env_args)
    monkeypatch.setenv(name, "from-the-environment")
    async with Receiver([ok({"reward": 1})], secret="from-the-environment") as receiver:
        hook = FACTORIES[0].build(env_args.model_copy(update={"url": receiver.url}))
        monkeypatch.delenv(name)
        result = await run(hook, session(), context(http))
    assert result == HookResult(session=1.0)
    assert [seen.valid for seen in receiver.seen] == [True]


def test_the_factories():
    assert [(f.name, f.level, f.args) for f in FACTORIES] == [
        ("webhook", "session", WebhookArgs),
        ("group_webhook", "group", WebhookArgs),
    ]
    assert FACTORIES[0].build(args("https://example.com/hook")).level == "session"


def test_session_json_is_plain_json():
    encoded = session_json(session())
    assert json.loads(json.dumps(encoded)) == encoded
    assert encoded["completions"][1] == {
        "id": "c2",
        "parent_id": "c1",
        "messages": [{"role": "user", "content": "What is 6 * 7?"}],
        "message": {"role": "assistant", "content": "42"},
        "text": "42",
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "finish_reason": "stop",
        "trainable": True,
    }
    assert encoded["metadata"] == {"answer": "42"}
    assert encoded["task"] == {"question": "What is 6 * 7?"}
