"""The bare passthrough: the floor any Python proxy pays. aiohttp server, one shared aiohttp
ClientSession upstream, the body and the answer copied through (streams chunk by chunk), no parsing,
no auth, no recording.

With `--sqlite PATH` it is the floor of a proxy that records (the `passthrough-sqlite` stack of
benchmarks/results/proxy_overhead.json): each request and its answer are inserted as one row (sqlite3,
WAL, synchronous=NORMAL, on one writer thread, one transaction per request) and committed before the
answer ends (a stream's last piece is held back until then), as Flywheel records before it answers.
Still no parsing and no auth.
With `--postgres URL` the row goes to Postgres instead: one INSERT in autocommit per request on a pool
of asyncpg connections, the floor of a proxy that records there.

    python -m benchmarks.overhead.passthrough --port 8100 --upstream http://127.0.0.1:30000
        [--sqlite FILE | --postgres postgresql://...]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import aiohttp
import asyncpg
from aiohttp import web

HTTP = web.AppKey("http", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", str)


class CallRecorder(Protocol):
    async def record(self, request: bytes, response: bytes) -> None:
        """Insert and commit one row holding the request and its whole answer."""

    async def count(self) -> int:
        """The rows committed so far."""


class RowRecorder:
    """One row per request in SQLite, inserted and committed on one writer thread."""

    def __init__(self, path: str) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="passthrough-sqlite")
        self._connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._connection.execute("PRAGMA journal_mode = WAL")
        self._connection.execute("PRAGMA synchronous = NORMAL")
        self._connection.execute(
            "CREATE TABLE IF NOT EXISTS calls (id TEXT PRIMARY KEY, request BLOB, response BLOB)"
        )

    async def record(self, request: bytes, response: bytes) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._insert, request, response)

    def _insert(self, request: bytes, response: bytes) -> None:
        self._connection.execute("BEGIN IMMEDIATE")
        self._connection.execute("INSERT INTO calls VALUES (?, ?, ?)", (uuid.uuid4().hex, request, response))
        self._connection.execute("COMMIT")

    async def count(self) -> int:
        return int(self._connection.execute("SELECT count(*) FROM calls").fetchone()[0])


class PostgresRowRecorder:
    """One row per request in Postgres: one INSERT in autocommit (one round trip) on a pool of asyncpg
    connections, opened and closed with the app."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._pool: asyncpg.Pool | None = None

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(self._url, min_size=1, max_size=8)
        await self._pool.execute(
            "CREATE TABLE IF NOT EXISTS calls (id text PRIMARY KEY, request bytea, response bytea)"
        )

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    async def record(self, request: bytes, response: bytes) -> None:
        assert self._pool is not None, "the recorder opens with the app"
        await self._pool.execute("INSERT INTO calls VALUES ($1, $2, $3)", uuid.uuid4().hex, request, response)

    async def count(self) -> int:
        assert self._pool is not None, "the recorder opens with the app"
        return int(await self._pool.fetchval("SELECT count(*) FROM calls"))


RECORDER: web.AppKey[CallRecorder | None] = web.AppKey("recorder")


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    url = request.app[UPSTREAM] + request.path
    recorder = request.app[RECORDER]
    async with request.app[HTTP].post(url, data=body, headers=headers) as upstream:
        content_type = upstream.headers.get("Content-Type", "application/json")
        if not content_type.startswith("text/event-stream"):
            payload = await upstream.read()
            if recorder is not None:
                await recorder.record(body, payload)
            return web.Response(body=payload, status=upstream.status, content_type=content_type.split(";")[0])
        response = web.StreamResponse(status=upstream.status, headers={"Content-Type": content_type})
        await response.prepare(request)
        if recorder is None:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        else:  # the last piece waits for the record
            pieces: list[bytes] = []
            async for chunk in upstream.content.iter_any():
                if pieces:
                    await response.write(pieces[-1])
                pieces.append(chunk)
            await recorder.record(body, b"".join(pieces))
            if pieces:
                await response.write(pieces[-1])
        await response.write_eof()
        return response


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def build_app(
    upstream: str, sqlite_path: str | None = None, postgres_url: str | None = None
) -> web.Application:
    if sqlite_path and postgres_url:
        raise ValueError("record to SQLite or to Postgres, not both")
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")
    postgres = PostgresRowRecorder(postgres_url) if postgres_url else None
    app[RECORDER] = RowRecorder(sqlite_path) if sqlite_path else postgres

    async def session(app: web.Application):  # type: ignore[no-untyped-def]
        app[HTTP] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        if postgres is not None:
            await postgres.open()
        yield
        if postgres is not None:
            await postgres.close()
        await app[HTTP].close()

    app.cleanup_ctx.append(session)
    app.router.add_get("/health", health)
    app.router.add_post("/{path:.*}", forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    recording = parser.add_mutually_exclusive_group()
    recording.add_argument("--sqlite", default=None, help="record one row per request in this SQLite file")
    recording.add_argument("--postgres", default=None, help="record one row per request in this database")
    args = parser.parse_args()
    web.run_app(
        build_app(args.upstream, args.sqlite, args.postgres),
        host="127.0.0.1", port=args.port, access_log=None, print=None, backlog=4096,
    )


if __name__ == "__main__":
    main()
