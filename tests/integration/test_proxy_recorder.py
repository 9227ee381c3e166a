"""The recorder's group commit on SQLite and Postgres: concurrent writes share transactions, every
caller returns only once its rows are committed, and one bad record fails only its own caller."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import func, select

from proxy.metrics import ProxyMetrics
from proxy.recording.recorder import Recorder, RecorderClosed
from storage.engine import SessionFactory
from storage.models import Completion
from storage.queries import create_session
from storage.records import CompletionRecord, SessionRecord


def completion(completion_id: str, session_id: str = "s1") -> CompletionRecord:
    return CompletionRecord(
        id=completion_id, session_id=session_id, parent_id=None, prompt_ids=[1, 2, 3], output_ids=[4, 5],
        output_logprobs=[-0.1, -0.2], output_versions=[0, 0], finish_reason="stop", temperature=1.0,
        top_p=1.0, top_k=-1, request_json={"messages": []}, response_json={"id": completion_id},
    )


async def count(session_factory: SessionFactory) -> int:
    async with session_factory() as db:
        return int((await db.execute(select(func.count()).select_from(Completion))).scalar_one())


def histogram(metrics: ProxyMetrics, suffix: str) -> float:
    value = metrics.registry.get_sample_value(f"flywheel_proxy_record_batch_size_{suffix}")
    assert value is not None
    return value


@pytest.fixture
async def recorder(session_factory: SessionFactory) -> Recorder:
    await create_session(session_factory, SessionRecord(id="s1", key_hash="0" * 64))
    return Recorder(session_factory, batch_max=256, metrics=ProxyMetrics())


async def test_concurrent_writes_share_transactions(
    recorder: Recorder, session_factory: SessionFactory
) -> None:
    recorder.start()
    await asyncio.gather(*(recorder.record([completion(f"c{i}")]) for i in range(64)))
    assert await count(session_factory) == 64  # committed before record() returned
    metrics = recorder._metrics
    assert histogram(metrics, "sum") == 64
    assert histogram(metrics, "count") < 64  # group commit: fewer transactions than callers
    await recorder.stop()


async def test_a_bad_record_fails_only_its_caller(
    recorder: Recorder, session_factory: SessionFactory
) -> None:
    recorder.start()
    results = await asyncio.gather(
        recorder.record([completion("ok-1")]),
        recorder.record([completion("bad", session_id="no-such-session")]),
        recorder.record([completion("ok-2"), completion("ok-3")]),
        return_exceptions=True,
    )
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], Exception)
    async with session_factory() as db:
        ids = set((await db.execute(select(Completion.id))).scalars())
    assert ids == {"ok-1", "ok-2", "ok-3"}
    await recorder.stop()


async def test_stop_drains_then_refuses(recorder: Recorder, session_factory: SessionFactory) -> None:
    recorder.start()
    pending = [asyncio.create_task(recorder.record([completion(f"d{i}")])) for i in range(10)]
    await asyncio.sleep(0)
    await recorder.stop()
    await asyncio.gather(*pending)
    assert await count(session_factory) == 10
    with pytest.raises(RecorderClosed):
        await recorder.record([completion("late")])
