"""Online keys at scale: what a call on an online key costs as the key's active sessions grow.

Every conversation on an online key is a session of its own, and a call joins the one whose conversation
it extends (proxy/online.py), so a live deployment holds as many active sessions as conversations went on
within the finalizer's `session_ttl_s`. This opens conversations on one online key (each a first call,
one user message) in front of the benchmark's scripted worker, and at each size measures, one client:

- a first call (a new conversation: it makes a session);
- a continuation (a conversation picked at random, its first answer and one more user message).

    .venv/bin/python benchmarks/online_sessions.py [--sessions 1,100,1000] [--calls 100]
        [--db sqlite,postgres]

The scripted worker's answers are four letters, so some hundred conversations in a thousand share an
answer; real answers collide less, which only makes a continuation cheaper.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.overhead import stacks


def online_key(db_url: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", "keys", "create", "--online", f"storage.url={db_url}"],
        cwd=stacks.REPO, env=stacks._env(), capture_output=True, text=True, timeout=300, check=True,
    )
    return result.stdout.strip().splitlines()[-1]


async def _warm_up(base_url: str, key: str) -> None:
    """A fresh proxy's one-off costs (first render, first session, connections), on another key."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
        for i in range(20):
            messages = [{"role": "user", "content": f"Warm-up {i}."}]
            body = {"model": "tiny", "messages": messages, "max_tokens": 4}
            async with http.post(f"{base_url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()


async def _measure(base_url: str, key: str, sizes: list[int], calls: int) -> list[tuple[int, float, float]]:
    """(active sessions, first-call p50 ms, continuation p50 ms) at each size."""
    rng = random.Random(0)
    opened: list[list[dict[str, Any]]] = []
    rows = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:

        async def call(messages: list[dict[str, Any]]) -> tuple[float, str]:
            body = {"model": "tiny", "messages": messages, "max_tokens": 4}
            started = time.perf_counter()
            async with http.post(f"{base_url}/v1/chat/completions", json=body) as response:
                answer = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {answer}")
            return (time.perf_counter() - started) * 1000, answer["choices"][0]["message"]["content"]

        async def first() -> float:
            messages = [{"role": "user", "content": f"Conversation {len(opened)}."}]
            elapsed, answer = await call(messages)
            opened.append([*messages, {"role": "assistant", "content": answer}])
            return elapsed

        for size in sizes:
            while len(opened) < size - calls // 2:  # untimed: the sessions up to this size
                await first()
            firsts = [await first() for _ in range(max(0, size - len(opened)))]
            continued = [
                (await call([*rng.choice(opened), {"role": "user", "content": f"More, {i}."}]))[0]
                for i in range(calls)
            ]
            row = (len(opened), statistics.median(firsts or [math.nan]), statistics.median(continued))
            print(f"  {row[0]:>6} sessions  first {row[1]:6.2f} ms  continued {row[2]:6.2f} ms", flush=True)
            rows.append(row)
    return rows


def _database(kind: str) -> AbstractContextManager[str]:
    return stacks.sqlite_database() if kind == "sqlite" else stacks.postgres_database()


def run(kinds: list[str], sizes: list[int], calls: int) -> Iterator[tuple[str, int, float, float]]:
    with tempfile.TemporaryDirectory(prefix="online-sessions-") as scratch:
        logs = Path(scratch)
        with stacks.worker(logs) as worker:
            for kind in kinds:
                print(f"{kind}:", flush=True)
                with _database(kind) as db_url:
                    with stacks.flywheel_proxy(logs, db_url, worker.url, 1) as proxy:
                        asyncio.run(_warm_up(proxy.url, online_key(db_url)))
                        for row in asyncio.run(_measure(proxy.url, online_key(db_url), sizes, calls)):
                            yield (kind, *row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", default="1,100,1000", help="active sessions to measure at, ascending")
    parser.add_argument("--calls", type=int, default=100, help="continuations timed at each size")
    parser.add_argument("--db", default="sqlite,postgres")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sessions.split(","))
    rows = list(run(args.db.split(","), sizes, args.calls))
    print("\n| database | active sessions | first call p50 ms | continuation p50 ms |")
    print("| --- | ---: | ---: | ---: |")
    for kind, size, first, continued in rows:
        print(f"| {kind} | {size:,} | {first:.2f} | {continued:.2f} |")


if __name__ == "__main__":
    main()
