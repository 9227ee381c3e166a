"""The proxy's completion writes, done the cheapest way each database allows (the recorder's hot path).

- SQLite: aiosqlite hops to its thread and back for every statement (BEGIN, INSERT, COMMIT, the pool's
  reset...), about eight event-loop wake-ups per transaction, and a SQLAlchemy Core execute costs more
  than the one-row insert itself. `SqliteThreadWriter` runs the whole transaction in one call on a
  dedicated thread with the sqlite3 driver, on its own connection to the same file with the same
  pragmas. Waiting on a lock (busy_timeout) blocks that thread, never the loop.
- Postgres: a Core insert in `engine.begin()` is a pool checkout, then BEGIN, INSERT and COMMIT, each a
  round trip to the server, then the pool's reset. `AsyncpgWriter` keeps one connection and sends one
  statement per transaction with the asyncpg driver: a single row in autocommit, a batch as one
  `executemany` (atomic since asyncpg 0.22). One round trip either way.

Both execute one INSERT written once (`CompletionInsert`) with each column's own SQLAlchemy bind
processor applied, so rows are stored exactly as SQLAlchemy would store them. Either way a write returns
only once its transaction has committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import asyncpg
from sqlalchemy import Dialect, Engine, Table, event, make_url
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.schema import CallableColumnDefault, ScalarElementColumnDefault

from storage.engine import POSTGRES_DRIVER, SQLITE_DRIVER, SessionFactory, json_text
from storage.models import Completion
from storage.queries import _completion_row
from storage.records import CompletionRecord

T = TypeVar("T")
_PRAGMAS = ("busy_timeout", "synchronous", "foreign_keys")


class CompletionWriter(Protocol):
    async def write(self, records: Sequence[CompletionRecord]) -> None:
        """Insert `records` in one transaction; returns once committed."""

    async def close(self) -> None:
        """Release connections and threads; the writer may not be used afterwards."""


def completion_writer(session_factory: SessionFactory) -> CompletionWriter:
    """The fastest writer for the database behind `session_factory`."""
    engine: AsyncEngine = session_factory.kw["bind"]
    if engine.url.drivername == SQLITE_DRIVER:
        return SqliteThreadWriter(engine)
    if engine.url.drivername == POSTGRES_DRIVER:
        return AsyncpgWriter(engine)
    raise ValueError(f"no completion writer for the driver {engine.url.drivername!r}")


# A positional parameter marker (1-based) per DB-API paramstyle of the drivers we use.
_MARKS: dict[str, Callable[[int], str]] = {"qmark": lambda _: "?", "numeric_dollar": lambda i: f"${i}"}


class CompletionInsert:
    """The completions INSERT for a driver, written once: its SQL (the driver's positional markers), and
    per row the parameter tuple SQLAlchemy would bind (each column's bind processor for the dialect
    applied, Python-side defaults filled in)."""

    def __init__(self, dialect: Dialect) -> None:
        mark = _MARKS.get(dialect.paramstyle)
        if mark is None:
            raise ValueError(f"unsupported DB-API paramstyle {dialect.paramstyle!r}")
        table = cast(Table, Completion.__table__)
        self.columns = [column.key for column in table.columns]
        self.sql = (
            f"INSERT INTO {table.name} ({', '.join(column.name for column in table.columns)}) "
            f"VALUES ({', '.join(mark(i) for i in range(1, len(self.columns) + 1))})"
        )
        self._processors = [
            column.type.dialect_impl(dialect).bind_processor(dialect) for column in table.columns
        ]
        self._defaults: dict[str, Callable[[], Any]] = {}
        for column in table.columns:
            default = column.default
            if isinstance(default, ScalarElementColumnDefault | CallableColumnDefault):
                self._defaults[column.key] = _default_factory(default)

    def values(self, row: dict[str, Any]) -> tuple[Any, ...]:
        values = []
        for key, process in zip(self.columns, self._processors, strict=True):
            value = row[key] if key in row else self._default(key)
            values.append(process(value) if process is not None and value is not None else value)
        return tuple(values)

    def _default(self, key: str) -> Any:
        factory = self._defaults.get(key)
        if factory is None:
            raise ValueError(f"completion row has no value for {key!r} and the column has no default")
        return factory()


def _default_factory(default: ScalarElementColumnDefault | CallableColumnDefault) -> Callable[[], Any]:
    if isinstance(default, CallableColumnDefault):
        function = cast(Callable[[Any], Any], default.arg)
        return lambda: function(None)  # SQLAlchemy wraps a no-argument default to take a context
    value = default.arg
    return lambda: value


# Pooled connections tried before a write gives up: the pool's idle ones may all have been ended.
_CHECKOUT_ATTEMPTS = 3


class AsyncpgWriter:
    """One statement per transaction with the asyncpg driver, on a connection of the engine's pool that
    the writer keeps (SQLAlchemy's connect hooks ran on it: the JSON codecs its bind processors expect).
    Writes are serialized. A failed write is not retried here (the recorder retries a failed batch one
    completion at a time); a connection that failed other than by the server refusing the statement
    (lost, cancelled mid-statement) is invalidated, and the next write takes a fresh one."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._insert = CompletionInsert(engine.dialect)
        self._connection: AsyncConnection | None = None
        self._driver: Any = None
        self._lock = asyncio.Lock()

    async def write(self, records: Sequence[CompletionRecord]) -> None:
        if not records:
            return
        statement = self._insert
        rows = [statement.values(_completion_row(record)) for record in records]
        async with self._lock:
            driver = await self._driver_connection()
            try:
                if len(rows) == 1:  # one statement in autocommit is its own transaction
                    await driver.execute(statement.sql, *rows[0])
                else:
                    await driver.executemany(statement.sql, rows)
            except BaseException as exc:
                # A statement the server refused leaves nothing written and the connection usable;
                # anything else (a lost connection, a cancellation mid-statement) costs the connection.
                if not isinstance(exc, asyncpg.PostgresError) or driver.is_closed():
                    await asyncio.shield(self._invalidate())
                raise

    async def _driver_connection(self) -> Any:
        """The kept connection's asyncpg driver; a new one is checked out of the pool and pinged once
        (the pool may hold connections the server has ended; only SQLAlchemy's own executes notice)."""
        if self._connection is not None:
            return self._driver
        for attempt in range(1, _CHECKOUT_ATTEMPTS + 1):
            self._connection = await self._engine.connect()
            try:
                self._driver = (await self._connection.get_raw_connection()).driver_connection
                await self._driver.execute("SELECT 1")
                return self._driver
            except (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError):
                await asyncio.shield(self._invalidate())
                if attempt == _CHECKOUT_ATTEMPTS:
                    raise
            except BaseException:
                await asyncio.shield(self._invalidate())
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _invalidate(self) -> None:
        connection, self._connection, self._driver = self._connection, None, None
        if connection is not None:
            await connection.invalidate()
            await connection.close()

    async def close(self) -> None:
        async with self._lock:
            connection, self._connection, self._driver = self._connection, None, None
            if connection is not None:
                await connection.close()


class CallThread:
    """One daemon thread that runs the calls given to `run`, in order. Awaiting one costs a queue put and
    one event-loop wake-up when it is done: `run_in_executor` adds a concurrent.futures Future chained
    to the asyncio one, the executor's locks and its idle-thread bookkeeping, which showed in profiles
    of the proxy's event loop under many concurrent clients."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, done, function, args))
        return await done

    def stop(self) -> None:
        """End the thread once the calls already given have run."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, done, function, args = call
            try:
                outcome: tuple[bool, Any] = (True, function(*args))
            except BaseException as exc:  # handed to the awaiting task, which raises it
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
                loop.call_soon_threadsafe(_settle, done, outcome)


_Call = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


def _settle(done: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if done.cancelled():
        return
    succeeded, value = outcome
    if succeeded:
        done.set_result(value)
    else:
        done.set_exception(value)


class SqliteThreadWriter:
    """Whole transactions on one dedicated thread with the sqlite3 driver. The thread and its connection
    are made on first use, with the pragmas the async engine's connections have."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._async_engine = engine
        self._engine: Engine | None = None
        self._insert_sql: CompletionInsert | None = None
        self._thread: CallThread | None = None
        # Used only on the writer thread: kept open between transactions, as checking a connection out
        # of the pool and resetting it on return cost more than the one-row insert itself.
        self._connection: Any = None

    async def write(self, records: Sequence[CompletionRecord]) -> None:
        if not records:
            return
        if self._engine is None or self._thread is None or self._insert_sql is None:
            self._engine = await self._twin_engine()
            self._insert_sql = CompletionInsert(self._engine.dialect)
            self._thread = CallThread("flywheel-sqlite-writer")
        statement = self._insert_sql
        rows = [statement.values(_completion_row(record)) for record in records]
        await self._thread.run(self._insert, self._engine, statement.sql, rows)

    def _insert(self, engine: Engine, sql: str, rows: list[tuple[Any, ...]]) -> None:
        if self._connection is None:
            self._connection = engine.raw_connection()  # the pool's connection: its connect hook ran
        driver = self._connection.driver_connection
        try:
            if len(rows) == 1:
                # One statement in autocommit is its own transaction, and its write lock is taken (busy
                # handler included) when it starts: what BEGIN IMMEDIATE ... COMMIT does, in one call
                # instead of three. Each call releases and retakes the GIL, which the event loop wants.
                driver.execute(sql, rows[0])
            else:
                driver.execute("BEGIN IMMEDIATE")  # take the write lock up front (isolation_level is None)
                driver.executemany(sql, rows)
                driver.execute("COMMIT")
        except BaseException:
            connection, self._connection = self._connection, None
            try:
                if driver.in_transaction:
                    driver.execute("ROLLBACK")
            finally:
                connection.invalidate()  # the next transaction starts on a fresh connection
            raise

    def _dispose(self, engine: Engine) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        engine.dispose()

    async def close(self) -> None:
        engine, thread = self._engine, self._thread
        self._engine = self._thread = None
        if engine is not None and thread is not None:
            await thread.run(self._dispose, engine)
            thread.stop()

    async def _twin_engine(self) -> Engine:
        """A synchronous engine on the same file whose connections get the async ones' pragmas."""
        async with self._async_engine.connect() as connection:
            pragmas = {name: (await connection.exec_driver_sql(f"PRAGMA {name}")).scalar_one()
                       for name in _PRAGMAS}
        url = make_url(self._async_engine.url).set(drivername="sqlite")
        # The writer keeps one connection; a second one serves anything else (reading the pragmas back).
        engine = create_sync_engine(url, pool_size=2, max_overflow=0, json_serializer=json_text)

        def on_connect(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None  # BEGIN is ours, as in storage/engine.py
            for name, value in pragmas.items():
                dbapi_connection.execute(f"PRAGMA {name} = {int(value)}")

        event.listen(engine, "connect", on_connect)
        return engine
