"""storage/writer.py, the recorder's write path: rows land committed and readable on SQLite and Postgres,
stored as SQLAlchemy stores them, one failed transaction leaving nothing; a lost Postgres connection is
replaced; on SQLite the writer's own connection keeps the configured pragmas and waits for another
writer's lock on its thread while the event loop goes on."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import asyncpg
import numpy as np
import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker, write_transaction
from storage.migrate import upgrade
from storage.models import Completion
from storage.queries import create_session, record_completions
from storage.records import CompletionRecord, SessionRecord
from storage.writer import SqliteThreadWriter, completion_writer


def completion(completion_id: str) -> CompletionRecord:
    return CompletionRecord(
        id=completion_id, session_id="s1", parent_id=None, prompt_ids=[1, 2, 3], output_ids=[4, 5],
        output_logprobs=[-0.25, -0.5], output_versions=[7, 8], finish_reason="stop", temperature=0.7,
        top_p=0.9, top_k=-1, request_json={"messages": [{"role": "user", "content": "hé"}]},
        response_json={"id": completion_id, "choices": []},
    )


async def test_written_rows_read_back_exactly(db_url: str) -> None:
    engine = create_engine(StorageConfig(url=db_url))
    factory = create_sessionmaker(engine)
    await create_session(factory, SessionRecord(id="s1", key_hash="0" * 64))
    writer = completion_writer(factory)
    try:
        await writer.write([completion("a"), completion("b")])
        async with factory() as db:
            rows = {row.id: row for row in (await db.execute(select(Completion))).scalars()}
    finally:
        await writer.close()
        await engine.dispose()
    assert set(rows) == {"a", "b"}
    row = rows["a"]
    assert row.prompt_ids.tolist() == [1, 2, 3] and row.output_versions.tolist() == [7, 8]
    assert np.allclose(row.output_logprobs, [-0.25, -0.5])
    assert (row.temperature, row.top_p, row.top_k, row.branched) == (0.7, 0.9, -1, False)
    assert row.request_json["messages"][0]["content"] == "hé"
    assert row.created_at is not None


@asynccontextmanager
async def writer_on(db_url: str, **storage: Any) -> AsyncIterator[tuple[AsyncEngine, SessionFactory, Any]]:
    """A migrated database (`db_url`) with session s1: its engine, session factory and completion writer."""
    engine = create_engine(StorageConfig(url=db_url, **storage))
    factory = create_sessionmaker(engine)
    await create_session(factory, SessionRecord(id="s1", key_hash="0" * 64))
    writer = completion_writer(factory)
    try:
        yield engine, factory, writer
    finally:
        await writer.close()
        await engine.dispose()


@asynccontextmanager
async def sqlite_writer(path: str, **storage: Any) -> AsyncIterator[tuple[AsyncEngine, SessionFactory, Any]]:
    """`writer_on` a SQLite file migrated here."""
    url = f"sqlite+aiosqlite:///{path}"
    await asyncio.to_thread(upgrade, url)
    async with writer_on(url, **storage) as opened:
        yield opened


async def test_sqlite_writer_keeps_pragmas_and_waits_for_the_lock_off_the_loop(tmp_path: object) -> None:
    storage = {"sqlite_busy_timeout_ms": 12345, "sqlite_synchronous": "FULL"}
    async with sqlite_writer(f"{tmp_path}/w.db", **storage) as (_engine, factory, writer):
        assert isinstance(writer, SqliteThreadWriter)
        async with write_transaction(factory):  # another writer holds the lock (BEGIN IMMEDIATE)
            write = asyncio.create_task(writer.write([completion("late")]))
            ticks = 0
            while ticks < 50:  # the loop keeps running while the write waits on its thread
                await asyncio.sleep(0.01)
                ticks += 1
            assert not write.done()
        await write
        async with factory() as db:
            assert (await db.execute(select(Completion.id))).scalars().all() == ["late"]
        twin, thread = writer._engine, writer._thread
        assert twin is not None and thread is not None
        pragmas = await thread.run(_pragmas, twin)
        assert pragmas == {"busy_timeout": 12345, "synchronous": 2, "foreign_keys": 1}


def _pragmas(engine: object) -> dict[str, int]:
    with engine.connect() as connection:  # type: ignore[attr-defined]
        return {name: int(connection.execute(text(f"PRAGMA {name}")).scalar_one())
                for name in ("busy_timeout", "synchronous", "foreign_keys")}


async def test_the_writer_stores_what_sqlalchemy_stores(db_url: str) -> None:
    """The writer binds values itself (storage.writer.CompletionInsert, each column's bind processor for
    the dialect): each column must hold the very bytes and types SQLAlchemy's own INSERT of the same record
    stores, on both databases."""
    record = replace(
        completion("x"), prompt_ids=np.array([1, 2, 2**31 - 1], dtype=np.int64),
        output_logprobs=[-0.1, -np.inf], branched=True,
        response_json={"nul": "a\u0000b", "float": 0.1, "none": None}, parent_id=None,
    )
    async with writer_on(db_url) as (engine, factory, writer):
        await record_completions(factory, [replace(record, id="by-sqlalchemy")])
        await writer.write([replace(record, id="by-writer")])
        await writer.write([replace(record, id="by-writer-batch-1"), replace(record, id="by-writer-batch-2")])
        sqlite = engine.dialect.name == "sqlite"
        # Postgres's json type keeps the text as written: comparing it compares the bytes stored.
        query = (
            "SELECT *, typeof(created_at) FROM completions ORDER BY id" if sqlite
            else "SELECT *, request_json::text AS request_text, response_json::text AS response_text, "
            "pg_typeof(created_at)::text FROM completions ORDER BY id"
        )
        async with engine.connect() as connection:
            rows = [dict(row._mapping) for row in (await connection.exec_driver_sql(query)).all()]
    by_sqlalchemy = rows[0]
    created = by_sqlalchemy.pop("created_at")
    assert by_sqlalchemy.pop("id") == "by-sqlalchemy"
    for written, name in zip(rows[1:], ["by-writer", "by-writer-batch-1", "by-writer-batch-2"], strict=True):
        assert written.pop("id") == name
        at = written.pop("created_at")
        assert written == by_sqlalchemy
        if sqlite:
            assert len(at) == len(created) and at >= created  # the same text format, in order
        else:
            assert at.tzinfo == created.tzinfo and at >= created


async def test_the_writer_fails_one_transaction_and_goes_on(db_url: str) -> None:
    postgres = db_url.startswith("postgresql")
    integrity = asyncpg.IntegrityConstraintViolationError if postgres else sqlite3.IntegrityError
    async with writer_on(db_url) as (_engine, factory, writer):
        with pytest.raises(integrity):  # no such session: a foreign key violation
            bad = replace(completion("bad"), session_id="nope")
            await writer.write([completion("ok-but-rolled-back"), bad])
        with pytest.raises(integrity):  # one row: one statement in autocommit, no BEGIN
            await writer.write([bad])
        with pytest.raises(integrity):  # the same id twice: the second row fails
            await writer.write([completion("twice"), completion("twice")])
        with pytest.raises(ValueError, match="differ in length"):
            await writer.write([replace(completion("short"), output_versions=[1])])
        await writer.write([completion("after")])
        async with factory() as db:
            assert (await db.execute(select(Completion.id))).scalars().all() == ["after"]


@pytest.mark.postgres
@pytest.mark.parametrize("empty_db_url", ["postgres"], indirect=True)
async def test_postgres_writer_replaces_a_lost_connection(db_url: str) -> None:
    """The writer keeps one connection: when the server ends it, the write in flight fails (the recorder
    retries it) and the next one runs on a fresh connection."""
    async with writer_on(db_url) as (engine, factory, writer):
        await writer.write([completion("before")])
        async with engine.connect() as connection:  # end every other backend of this database
            ended = await connection.exec_driver_sql(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert ended.scalar_one() >= 1
        # Which error the write in flight meets depends on when the server's goodbye arrives.
        with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)):
            await writer.write([completion("lost")])
        await writer.write([completion("after")])
        async with factory() as db:
            assert sorted((await db.execute(select(Completion.id))).scalars()) == ["after", "before"]


async def test_json_columns_are_valid_json_on_both_databases(db_url: str) -> None:
    """JSON columns are written with msgspec (storage.engine.json_text): NaN and ±inf (which json.dumps
    writes as bare tokens Postgres refuses) become null, NUL and non-ASCII text round-trip."""
    engine = create_engine(StorageConfig(url=db_url))
    factory = create_sessionmaker(engine)
    await create_session(factory, SessionRecord(id="s1", key_hash="0" * 64))
    odd = {"nan": float("nan"), "inf": float("-inf"), "text": "a\u0000b é 你", "n": [1, 2.5, None]}
    writer = completion_writer(factory)
    try:
        await writer.write([replace(completion("w"), response_json=odd)])
        await record_completions(factory, [replace(completion("q"), response_json=odd)])
        async with factory() as db:
            stored = {row.id: row.response_json for row in (await db.execute(select(Completion))).scalars()}
    finally:
        await writer.close()
        await engine.dispose()
    expected = {"nan": None, "inf": None, "text": "a\u0000b é 你", "n": [1, 2.5, None]}
    assert stored == {"w": expected, "q": expected}
