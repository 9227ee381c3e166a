"""Admission control and stale samples on real databases: the RL API refuses new sessions with a 429 in
OpenAI's shape exactly at (η + v + 1) · B and admits again once a step is recorded or a session turns
out untrainable, online traffic is never refused, RLClient waits a refusal out; the trainer's claims
drop (and count) samples older than η with their groups, and never train on them."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import func, insert, select

from integrations.gsm8k.rl_api import RLClient, SessionHandle
from serving.client import WorkerPool
from serving.config import ClientConfig
from storage.admission import read_admission
from storage.claims import ClaimLostError, claim_batch, latest_policy_version, record_step
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.migrate import upgrade
from storage.models import Session, TrainStep
from storage.queries import insert_trajectories
from storage.records import StepRecord
from tests.support.admission import (
    admitted_group,
    holding_slots,
    online_samples,
    sample,
    train_step,
    trajectory_rows,
)
from tests.support.databases import run_outside_loop
from tests.support.feedback import new_online_key
from tests.support.proxy_harness import Proxy, ProxyFactory, metric, run_db
from tests.support.scripted_worker import ScriptedWorker
from tests.support.trainer_driver import FakePolicy
from trainer.config import TrainerConfig
from trainer.driver import Driver
from trainer.monitor import Monitor

REFUSED = "flywheel_proxy_admission_refused_total"


def _admission(batch_size: int, eta: int) -> dict[str, Any]:
    return {"enabled": True, "batch_size": batch_size, "max_head_offpolicyness": eta, "retry_after_s": 0.3}


def _post(proxy: Proxy, path: str, body: Any = None, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or proxy.admin_key}"}
    return httpx.post(f"{proxy.base_url}{path}", json=body or {}, headers=headers, timeout=30)


def _new_session(proxy: Proxy) -> httpx.Response:
    return _post(proxy, "/rl/v1/sessions", {"task": "t"})


def _finalize_trainable(proxy: Proxy, session_ids: list[str]) -> None:
    """Each session finalized with one trainable sample of version 0 (as the finalizer writes them)."""

    async def finalize(factory: SessionFactory) -> None:
        for session_id in session_ids:
            await insert_trajectories(factory, session_id, [sample(0)])

    run_db(proxy.db_url, finalize)


def _assert_refused(answer: httpx.Response, limit: int, admitted: int) -> None:
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert f"capacity of {limit}" in error["message"]
    assert answer.headers["retry-after"] == "1" and answer.headers["retry-after-ms"] == "300"
    assert answer.headers["x-ratelimit-limit-sessions"] == str(limit)
    assert answer.headers["x-ratelimit-remaining-sessions"] == str(max(limit - admitted, 0))


@pytest.mark.parametrize("db_url", ["sqlite", "postgres"], indirect=True)
def test_rl_api_refuses_at_the_capacity_line_and_admits_again(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    proxy = proxies.start([scripted.url], admission=_admission(batch_size=2, eta=1))  # (1 + 0 + 1) · 2 = 4
    group = _post(proxy, "/rl/v1/groups", {"size": 2})
    assert group.status_code == 201, group.text
    first = _new_session(proxy)
    assert first.status_code == 201
    _assert_refused(_post(proxy, "/rl/v1/groups", {"size": 2}), limit=4, admitted=3)  # 3 + 2 > 4: none of it
    fourth = _new_session(proxy)
    assert fourth.status_code == 201
    _assert_refused(_new_session(proxy), limit=4, admitted=4)
    _assert_refused(_post(proxy, "/rl/start_session", {"task_id": "t"}), limit=4, admitted=4)  # AReaL's too
    assert len(run_db(proxy.db_url, holding_slots)) == 4  # the refusals wrote nothing

    # Online traffic is never refused.
    online = openai.OpenAI(base_url=proxy.v1, api_key=new_online_key(proxy), max_retries=0)
    online.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)

    # A session that ends untrainable (AReaL's end: finalized now, and it has no completion) frees its slot.
    ended = _post(proxy, "/rl/end_session", key=first.json()["api_key"])
    assert ended.status_code == 200, ended.text
    # The end schedules the finalization; the slot is free once it ran.
    _wait_for(lambda: len(run_db(proxy.db_url, holding_slots)) == 3, "the ended session's slot")
    replacement = _new_session(proxy)
    assert replacement.status_code == 201, replacement.text
    _assert_refused(_new_session(proxy), limit=4, admitted=4)

    # Trainable sessions keep their slots once consumed (the count is cumulative); a step adds B.
    members = [s["session_id"] for s in group.json()["sessions"]]
    _finalize_trainable(proxy, [*members, fourth.json()["session_id"], replacement.json()["session_id"]])
    assert run_db(proxy.db_url, lambda factory: train_step(factory, step=1)) == 4
    assert [_new_session(proxy).status_code for _ in range(2)] == [201, 201]  # (1 + 1 + 1) · 2 = 6
    _assert_refused(_new_session(proxy), limit=6, admitted=6)
    assert run_db(proxy.db_url, read_admission).admitted == 6

    assert metric(proxy.base_url, REFUSED, {"kind": "session"}) == 4
    assert metric(proxy.base_url, REFUSED, {"kind": "group"}) == 1
    assert metric(proxy.base_url, "flywheel_proxy_admission_capacity") == 6


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_rl_client_waits_out_a_refusal(proxies: ProxyFactory, scripted: ScriptedWorker) -> None:
    proxy = proxies.start([scripted.url], admission=_admission(batch_size=1, eta=0))  # capacity 1
    got: list[SessionHandle] = []
    with RLClient(proxy.base_url, proxy.admin_key, max_wait_s=60) as client:
        held = client.create_session(task="first")
        waiter = threading.Thread(target=lambda: got.append(client.create_session(task="second")))
        waiter.start()
        _wait_for(lambda: metric(proxy.base_url, REFUSED, {"kind": "session"}) >= 1, "a refusal")
        assert not got
        _finalize_trainable(proxy, [held.session_id])
        run_db(proxy.db_url, lambda factory: train_step(factory, step=1))  # capacity 2
        waiter.join(30)
    assert not waiter.is_alive() and len(got) == 1
    assert got[0].session_id in run_db(proxy.db_url, holding_slots)


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def test_claims_drop_stale_samples_with_their_groups(session_factory: SessionFactory) -> None:
    old, edge, fresh = await online_samples(session_factory, [0, 3, 5])
    _, stale_group = await admitted_group(session_factory, [5, 2])  # one member older than η
    _, fresh_group = await admitted_group(session_factory, [5, 5])

    batch = await claim_batch(session_factory, size=10, current_version=5, max_staleness=2, drop_stale=True)
    assert batch.dropped == 3
    assert batch.ids == (edge, fresh, *fresh_group)
    rows = await trajectory_rows(session_factory)
    assert {i for i, row in rows.items() if row.dropped_at is not None} == {old, *stale_group}
    slots = await holding_slots(session_factory)
    assert not any(rows[i].session_id in slots for i in stale_group)  # nothing left to train: freed
    assert all(rows[i].session_id in slots for i in fresh_group)

    # Dropped is final: no claim takes them, however lenient, and nothing is dropped twice.
    again = await claim_batch(session_factory, size=10, current_version=5, max_staleness=50, drop_stale=True)
    assert (again.ids, again.dropped) == ((), 0)


async def test_a_sample_is_dropped_or_consumed_never_both(session_factory: SessionFactory) -> None:
    (only,) = await online_samples(session_factory, [0])
    held = await claim_batch(session_factory, size=1, current_version=0, max_staleness=0)
    assert held.ids == (only,)
    # Its lease runs out; a trainer far ahead finds it stale and drops it, so the first cannot record it.
    later = await claim_batch(session_factory, 1, 4, 1, lease_s=0, drop_stale=True)
    assert later.dropped == 1
    with pytest.raises(ClaimLostError):
        await record_step(session_factory, StepRecord(step=1, policy_version=1, checkpoint_path="/c"),
                          held.claim_token, held.ids)
    row = (await trajectory_rows(session_factory))[only]
    assert row.dropped_at is not None and row.consumed_step is None


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
async def test_trainer_never_trains_past_eta_and_counts_what_it_drops(
    session_factory: SessionFactory, tmp_path: Path
) -> None:
    eta, steps = 1, 4
    config = TrainerConfig(batch_size=2, max_head_offpolicyness=eta, total_steps=steps, poll_interval_s=0.01)
    done = asyncio.Event()

    async def traffic() -> None:
        """Each new version brings two fresh online samples and, from version 2 on, samples that went
        stale on the way (online traffic two versions old, and an RL group with such a member)."""
        seen = -1
        while not done.is_set():
            version = await latest_policy_version(session_factory) or 0
            if version > seen:
                seen = version
                if version >= 2:
                    await online_samples(session_factory, [version - 2])
                    await admitted_group(session_factory, [version, version - 2])
                await online_samples(session_factory, [version, version])
            await asyncio.sleep(0.005)

    async with ScriptedWorker() as worker, WorkerPool(ClientConfig(), [worker.url]) as pool:
        feeding = asyncio.create_task(traffic())
        driver = Driver(config, session_factory, FakePolicy(), pool.clients, tmp_path / "ckpt",
                        Monitor(tmp_path / "m.jsonl"))
        assert await asyncio.wait_for(driver.run(), 60) == steps
        done.set()
        await feeding

    rows = list((await trajectory_rows(session_factory)).values())
    trained = [(row.min_version, row.consumed_step) for row in rows if row.consumed_step is not None]
    assert trained and all(oldest >= step - 1 - eta for oldest, step in trained)
    dropped = [row for row in rows if row.dropped_at is not None]
    assert dropped and not any(row.consumed_step is not None for row in dropped)
    dropped_groups = {row.group_id for row in dropped if row.group_id is not None}
    assert dropped_groups  # and whole: a group is trained whole or dropped whole
    assert all(row.dropped_at is not None for row in rows if row.group_id in dropped_groups)
    async with session_factory() as db:
        metrics = (await db.scalars(select(TrainStep.metrics))).all()
    assert sum(m["staleness/dropped"] for m in metrics) == len(dropped)  # every drop is counted once
    slots = await holding_slots(session_factory)
    assert not any(row.session_id in slots for row in dropped)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_upgrading_counts_the_sessions_the_rl_api_opened_before(empty_db_url: str) -> None:
    run_outside_loop(upgrade, empty_db_url, "0009")

    async def write_and_upgrade() -> set[str]:
        engine = create_engine(StorageConfig(url=empty_db_url))
        async with engine.begin() as connection:
            for sid, status, owner in [("running", "active", None), ("trained", "finalized", None),
                                       ("rejected", "finalized", None), ("online", "ended", "key-hash")]:
                ended = None if status == "active" else func.now()
                await connection.execute(insert(Session.__table__).values(
                    id=sid, metadata={}, status=status, ended_at=ended, owner_key_hash=owner))
            await connection.exec_driver_sql(
                "INSERT INTO trajectories (session_id, token_ids, loss_mask, logprobs, versions, reward,"
                " min_version) VALUES ('trained', X'', X'', X'', X'', 1.0, 0)"
            )
        await asyncio.to_thread(run_outside_loop, upgrade, empty_db_url)
        try:
            return await holding_slots(create_sessionmaker(engine))
        finally:
            await engine.dispose()

    assert run_outside_loop(lambda: asyncio.run(write_and_upgrade())) == {"running", "trained"}
