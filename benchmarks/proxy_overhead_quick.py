"""Proxy overhead, quick version: requests/s and latency (p50/p99) at 1 and 16 concurrent clients, for
the scripted (zero-latency) SGLang worker called directly with `/generate` vs through the proxy's
`/v1/chat/completions` with recording on SQLite (one row per request, group commit).

    .venv/bin/python benchmarks/proxy_overhead_quick.py [--seconds 5] [--max-tokens 8] [--stream]

The worker and the proxy run in their own processes (each with its own event loop, as deployed);
the load generator is one aiohttp client in this process. Each client sends its next request as soon
as the previous answer is complete. Every proxied completion is checked to be in the database at the
end. (The full benchmark, with streaming, Postgres and concurrency sweeps, is a later issue.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve_proxy(args: argparse.Namespace) -> None:
    """Child process: the proxy, as `flywheel proxy` runs it."""
    from proxy.config import ProxyConfig
    from proxy.server import run_proxy
    from serving.config import ServingConfig
    from storage.config import StorageConfig

    run_proxy(
        ProxyConfig(port=args.port),
        StorageConfig(url=args.db_url),
        ServingConfig(model=args.model, worker_urls=[args.worker_url]),
    )


def prepare_database(db_url: str) -> str:
    """Migrate a fresh database and return the key of one session for all clients."""
    from proxy.auth import SESSION_KEY_PREFIX, generate_api_key
    from storage.config import StorageConfig
    from storage.engine import create_engine, create_sessionmaker
    from storage.migrate import upgrade
    from storage.queries import create_session, hash_api_key
    from storage.records import SessionRecord

    upgrade(db_url)
    key = generate_api_key(SESSION_KEY_PREFIX)

    async def create() -> None:
        engine = create_engine(StorageConfig(url=db_url))
        session = SessionRecord(id="bench", key_hash=hash_api_key(key))
        await create_session(create_sessionmaker(engine), session)
        await engine.dispose()

    asyncio.run(create())
    return key


def count_completions(db_url: str) -> int:
    from sqlalchemy import func, select

    from storage.config import StorageConfig
    from storage.engine import create_engine, create_sessionmaker
    from storage.models import Completion

    async def count() -> int:
        engine = create_engine(StorageConfig(url=db_url))
        async with create_sessionmaker(engine)() as db:
            total = (await db.execute(select(func.count()).select_from(Completion))).scalar_one()
        await engine.dispose()
        return int(total)

    return asyncio.run(count())


async def wait_until_up(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


Request = Callable[[aiohttp.ClientSession], Awaitable[None]]


async def load(request: Request, clients: int, seconds: float) -> tuple[float, np.ndarray]:
    """Run `clients` closed-loop clients for `seconds` (after a short warm-up); (req/s, latencies s)."""
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        for _ in range(20):
            await request(http)
        stop_at = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                await request(http)
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, np.array(latencies)


def direct_request(worker_url: str, max_tokens: int, stream: bool) -> Request:
    body = json.dumps({"input_ids": [1, 287, 201, 74, 394, 81, 2, 201, 1, 372, 526, 201],
                       "sampling_params": {"max_new_tokens": max_tokens, "temperature": 1.0},
                       "return_logprob": True, "stream": stream})

    async def request(http: aiohttp.ClientSession) -> None:
        async with http.post(f"{worker_url}/generate", data=body,
                             headers={"Content-Type": "application/json"}) as response:
            assert response.status == 200, await response.text()
            await response.read()

    return request


def proxy_request(proxy_url: str, key: str, max_tokens: int, stream: bool) -> Request:
    body = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream})
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}

    async def request(http: aiohttp.ClientSession) -> None:
        async with http.post(f"{proxy_url}/v1/chat/completions", data=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            await response.read()

    return request


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--stream", action="store_true", help="streamed requests (SSE) on both paths")
    parser.add_argument("--model", default="tiny", help="whose tokenizer/chat template the proxy uses")
    parser.add_argument("--serve-proxy", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--db-url", help=argparse.SUPPRESS)
    parser.add_argument("--worker-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_proxy:
        serve_proxy(args)
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    worker_port, proxy_port = free_port(), free_port()
    worker_url, proxy_url = f"http://127.0.0.1:{worker_port}", f"http://127.0.0.1:{proxy_port}"
    with tempfile.TemporaryDirectory() as scratch:
        db_url = f"sqlite+aiosqlite:///{scratch}/bench.db"
        key = prepare_database(db_url)
        worker = subprocess.Popen(
            [sys.executable, "-m", "tests.support.scripted_worker", "--port", str(worker_port),
             "--no-record"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        proxy = subprocess.Popen(
            [sys.executable, __file__, "--serve-proxy", "--port", str(proxy_port), "--db-url", db_url,
             "--worker-url", worker_url, "--model", args.model],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            asyncio.run(wait_until_up(f"{worker_url}/health"))
            asyncio.run(wait_until_up(f"{proxy_url}/health"))
            rows = []
            for clients in (1, 16):
                for name, request in (
                    ("worker /generate directly", direct_request(worker_url, args.max_tokens, args.stream)),
                    ("proxy + SQLite recording", proxy_request(proxy_url, key, args.max_tokens, args.stream)),
                ):
                    rate, latencies = asyncio.run(load(request, clients, args.seconds))
                    rows.append((name, clients, rate, *np.percentile(latencies * 1000, [50, 99])))
            recorded = count_completions(db_url)
        finally:
            for process in (proxy, worker):
                process.terminate()
                process.wait(30)
    print(f"max_tokens={args.max_tokens} stream={args.stream} seconds/row={args.seconds} "
          f"cpus={os.cpu_count()}")
    print(f"{'target':<28} {'clients':>7} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for name, clients, rate, p50, p99 in rows:
        print(f"{name:<28} {clients:>7} {rate:>9.0f} {p50:>8.2f} {p99:>8.2f}")
    print(f"completions recorded: {recorded}")


if __name__ == "__main__":
    main()
