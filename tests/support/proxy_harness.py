"""The proxy's integration test harness: a real uvicorn proxy on a loopback port in a background thread,
scripted SGLang workers on their own event loop thread, keys, and readers of what the proxy recorded.
Servers never share the test's event loop, so sync and async `openai` clients can both talk to them.
The fixtures built on these (`servers`, `scripted`, `worker`, `proxies`, `proxy`) are in
tests/integration/conftest.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from proxy.auth import SESSION_KEY_PREFIX, create_admin_key, generate_api_key
from proxy.config import ProxyConfig
from proxy.server import serve_proxy_in_thread
from rewards.config import RewardsConfig
from serving.config import ClientConfig, ServingConfig
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.keys import KeyHasher
from storage.models import Completion, Session
from storage.queries import create_session
from storage.records import SessionRecord
from tests.support import scripted_worker
from tests.support.databases import key_hasher, run_outside_loop, storage_config
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

T = TypeVar("T")


class LoopThread:
    """An asyncio loop in a daemon thread, for servers the test talks to from another loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-servers", daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_scripted(self, **kwargs: Any) -> ScriptedWorker:
        async def start() -> ScriptedWorker:
            worker = ScriptedWorker(**kwargs)
            await worker.start()
            return worker

        return self.call(start())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():  # else it is still running: closing would fail
            self.loop.close()  # its selector and self-pipe: a long test session would run out of them


def run_db(db_url: str, fn: Callable[[SessionFactory], Awaitable[T]]) -> T:
    """Run `fn(session_factory)` on a fresh engine and loop, outside any running loop."""

    async def main() -> T:
        engine = create_engine(StorageConfig(url=db_url))
        try:
            return await fn(create_sessionmaker(engine))
        finally:
            await engine.dispose()

    return run_outside_loop(lambda: asyncio.run(main()))


async def new_session_key(session_factory: SessionFactory, hasher: KeyHasher) -> tuple[str, str]:
    """(session id, session key) of a new active session."""
    key = generate_api_key(SESSION_KEY_PREFIX)
    session_id = f"sess-{key[-12:]}"
    await create_session(session_factory, SessionRecord(id=session_id, key_hash=hasher.hash(key)))
    return session_id, key


async def _completions(session_factory: SessionFactory) -> list[Completion]:
    async with session_factory() as db:
        return list((await db.execute(select(Completion).order_by(Completion.created_at))).scalars())


async def _sessions(session_factory: SessionFactory) -> list[Session]:
    async with session_factory() as db:
        return list((await db.execute(select(Session).order_by(Session.created_at))).scalars())


async def _count_completions(session_factory: SessionFactory) -> int:
    async with session_factory() as db:
        return int((await db.execute(select(func.count()).select_from(Completion))).scalar_one())


@dataclass
class Proxy:
    """A running proxy and the keys and database behind it."""

    base_url: str
    db_url: str
    admin_key: str
    session_id: str
    session_key: str

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def client(self, key: str | None = None, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.v1, api_key=key or self.session_key, max_retries=0, **kwargs)

    def async_client(self, key: str | None = None, **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.v1, api_key=key or self.session_key, max_retries=0, **kwargs)

    def new_session_key(self) -> tuple[str, str]:
        """(session id, session key) of a new active session on this proxy's database."""
        hasher = key_hasher(self.db_url)
        return run_db(self.db_url, lambda factory: new_session_key(factory, hasher))

    def new_admin_key(self) -> str:
        hasher = key_hasher(self.db_url)
        return run_db(self.db_url, lambda factory: create_admin_key(factory, hasher))

    def completions(self) -> list[Completion]:
        return run_db(self.db_url, _completions)

    def completion(self, completion_id: str) -> Completion:
        found = [c for c in self.completions() if c.id == completion_id]
        assert found, f"completion {completion_id} was not recorded"
        return found[0]

    def count_completions(self) -> int:
        return run_db(self.db_url, _count_completions)

    def sessions(self) -> list[Session]:
        return run_db(self.db_url, _sessions)


@dataclass
class ProxyFactory:
    """Starts proxies (each with fresh keys) in front of given workers; stops them all at teardown."""

    db_url: str
    model_dir: Path
    stack: ExitStack = field(default_factory=ExitStack)

    def start(
        self, worker_urls: list[str], rewards: RewardsConfig | None = None, **proxy_settings: Any
    ) -> Proxy:
        hasher = key_hasher(self.db_url)
        admin_key = run_db(self.db_url, lambda factory: create_admin_key(factory, hasher))
        session_id, session_key = run_db(self.db_url, lambda factory: new_session_key(factory, hasher))
        settings = {"port": 0, **proxy_settings}
        serving = ServingConfig(
            model=str(self.model_dir), worker_urls=worker_urls,
            client=ClientConfig(connect_timeout_s=2.0, request_timeout_s=60.0),
        )
        base_url = self.stack.enter_context(
            serve_proxy_in_thread(ProxyConfig(**settings), storage_config(self.db_url), serving,
                                  rewards_config=rewards)
        )
        return Proxy(base_url, self.db_url, admin_key, session_id, session_key)


def session_completions(proxy: Proxy, session_id: str | None = None) -> list[Completion]:
    """The completions of the proxy's session (or `session_id`), oldest first."""
    rows = [c for c in proxy.completions() if c.session_id == (session_id or proxy.session_id)]
    return sorted(rows, key=lambda c: (c.created_at, c.id))


def metric(base_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of the proxy's /metrics with these labels, or 0 if it has none."""
    text = httpx.get(f"{base_url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(sample.value)
    return 0.0


def install_script(
    model_dir: Path, reply: Callable[[str], str] | Callable[[str, int], str], monkeypatch: pytest.MonkeyPatch,
    per_sample: bool = False,
) -> TextScript:
    """A scripted worker that writes `reply(prompt text)` (with `per_sample`, `reply(prompt text, sample
    index)`) in the tokens of the model in `model_dir` (pass the script to `start_scripted` as its token
    function, as the `worker` fixture does)."""
    script = TextScript(model_dir, reply, per_sample)
    monkeypatch.setattr(scripted_worker, "token_text", script.text)
    return script


def dead_worker_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"
