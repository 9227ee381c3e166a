"""User feedback tests' helpers (`POST /rl/v1/feedback`): online keys, the feedback call, readers of what
a feedback wrote (feedback rows, rewards, trajectories), a trainer's claim and step on a session's
trajectories, and a database trigger that makes feedback inserts fail (to show nothing is half-written).
Pass the async ones to `run_db` (tests/support/proxy_harness.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from sqlalchemy import make_url, select, text

from proxy.auth import create_online_key
from storage.claims import claim_batch, record_step
from storage.engine import SessionFactory
from storage.models import Feedback, Reward, Trajectory
from storage.records import ClaimedBatch, StepRecord
from tests.support.databases import key_hasher
from tests.support.proxy_harness import Proxy, run_db

SESSION_HEADER = "x-flywheel-session-id"


def new_online_key(proxy: Proxy) -> str:
    """A new online key on the proxy's database."""
    hasher = key_hasher(proxy.db_url)
    return run_db(proxy.db_url, lambda factory: create_online_key(factory, hasher))


def post_feedback(
    proxy: Proxy, key: str, body: Any = None, *, content: bytes | None = None
) -> httpx.Response:
    """`POST /rl/v1/feedback` with `body` as JSON, or `content` as the raw body."""
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{proxy.base_url}/rl/v1/feedback"
    if content is not None:
        return httpx.post(url, content=content, headers={**headers, "Content-Type": "application/json"})
    return httpx.post(url, json=body, headers=headers, timeout=30)


def rl(proxy: Proxy, method: str, path: str, key: str, body: Any = None) -> httpx.Response:
    return httpx.request(
        method, f"{proxy.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def chat(proxy: Proxy, key: str, text: str, **kwargs: Any) -> tuple[str, list[str]]:
    """(session id, completion ids: the response's id, then the other choices') of one chat call."""
    raw = proxy.client(key).chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": text}], max_tokens=4, **kwargs
    )
    response = raw.parse()
    ids = [response.id]
    for choice in response.choices[1:]:
        ids.append((choice.model_extra or {})["completion_id"])
    return raw.headers[SESSION_HEADER], ids


def wait_for_status(proxy: Proxy, session_id: str, status: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """`GET /rl/v1/sessions/{id}` (admin) once the session has `status`."""
    deadline = time.monotonic() + timeout_s
    while True:
        view: dict[str, Any] = rl(proxy, "GET", f"/rl/v1/sessions/{session_id}", proxy.admin_key).json()
        if view["status"] == status:
            return view
        assert time.monotonic() < deadline, f"session {session_id} is {view['status']}, not {status}"
        time.sleep(0.05)


async def _feedback_rows(factory: SessionFactory) -> list[Feedback]:
    async with factory() as db:
        return list((await db.execute(select(Feedback).order_by(Feedback.id))).scalars())


async def _reward_rows(factory: SessionFactory) -> list[Reward]:
    async with factory() as db:
        return list((await db.execute(select(Reward).order_by(Reward.id))).scalars())


def feedback_rows(proxy: Proxy) -> list[Feedback]:
    return run_db(proxy.db_url, _feedback_rows)


def reward_rows(proxy: Proxy, source: str | None = None) -> list[Reward]:
    """Every reward row, oldest first (of `source` only, when given)."""
    rows = run_db(proxy.db_url, _reward_rows)
    return [r for r in rows if source is None or r.source == source]


def trajectory_rewards(proxy: Proxy, session_id: str) -> list[float]:
    """The session's trajectories' rewards, by id."""

    async def read(factory: SessionFactory) -> list[float]:
        async with factory() as db:
            query = (
                select(Trajectory.reward).where(Trajectory.session_id == session_id).order_by(Trajectory.id)
            )
            return list((await db.execute(query)).scalars())

    return run_db(proxy.db_url, read)


def claim_all(proxy: Proxy) -> ClaimedBatch:
    """A trainer's claim of every claimable trajectory (policy version 0, synchronous)."""
    return run_db(proxy.db_url, lambda factory: claim_batch(factory, 256, 0, 0))


def consume_all(proxy: Proxy) -> None:
    """Claim every claimable trajectory and record a train step that consumes them."""
    batch = claim_all(proxy)
    assert batch.samples, "nothing to consume"
    ids = [sample.trajectory_id for sample in batch.samples]
    step = StepRecord(step=1, policy_version=1, checkpoint_path="/nowhere/v1")
    run_db(proxy.db_url, lambda factory: record_step(factory, step, batch.claim_token, ids))


_SQLITE_TRIGGER = (
    "CREATE TRIGGER refuse_feedback BEFORE INSERT ON feedback BEGIN SELECT RAISE(ABORT, 'refused'); END",
)
_POSTGRES_TRIGGER = (
    "CREATE FUNCTION refuse_feedback() RETURNS trigger AS $$ BEGIN RAISE EXCEPTION 'refused'; END $$ "
    "LANGUAGE plpgsql",
    "CREATE TRIGGER refuse_feedback BEFORE INSERT ON feedback FOR EACH ROW "
    "EXECUTE FUNCTION refuse_feedback()",
)
_DROP = {
    "sqlite": ("DROP TRIGGER refuse_feedback",),
    "postgresql": ("DROP TRIGGER refuse_feedback ON feedback", "DROP FUNCTION refuse_feedback()"),
}


@contextmanager
def feedback_inserts_fail(db_url: str) -> Iterator[None]:
    """While the block runs, the database refuses every insert into `feedback` (a trigger), as a failure
    at the transaction's last write would."""
    backend = make_url(db_url).get_backend_name()
    create = _SQLITE_TRIGGER if backend == "sqlite" else _POSTGRES_TRIGGER

    def execute(statements: tuple[str, ...]) -> None:
        async def run(factory: SessionFactory) -> None:
            async with factory() as db:
                for statement in statements:
                    await db.execute(text(statement))
                await db.commit()

        run_db(db_url, run)

    execute(create)
    try:
        yield
    finally:
        execute(_DROP[backend])
