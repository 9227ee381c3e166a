"""The load generator: closed-loop aiohttp clients (each sends its next request as soon as the previous
answer has been read to the end), after a warm-up. It runs in the benchmark's main process, never in a
server's."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import numpy as np

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]
PROMPT_IDS = [1, 287, 201, 74, 394, 81, 2, 201, 1, 372, 526, 201]

T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """What one client sends: a POST of `body` to `url`, with `keys[i % len(keys)]` for client i."""

    url: str
    body: bytes
    keys: Sequence[str] = ("none",)


@dataclass(frozen=True)
class Measurement:
    clients: int
    stream: bool
    seconds: float
    ok: int
    errors: int
    total_ok: int
    """Successful requests including the warm-up's (each one a recorded completion on Flywheel)."""
    latencies_ms: np.ndarray
    first_error: str | None

    @property
    def rate(self) -> float:
        return self.ok / self.seconds

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies_ms, q)) if len(self.latencies_ms) else float("nan")


def chat_target(base_url: str, model: str, max_tokens: int, stream: bool, keys: Sequence[str]) -> Target:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream}
    return Target(f"{base_url}/v1/chat/completions", json.dumps(body).encode(), tuple(keys) or ("none",))


def generate_target(base_url: str, max_tokens: int, stream: bool) -> Target:
    body = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 1.0},
        "return_logprob": True,
        "stream": stream,
    }
    return Target(f"{base_url}/generate", json.dumps(body).encode())


async def _send(http: aiohttp.ClientSession, target: Target, headers: dict[str, str]) -> str | None:
    """One request read to its end; None when it succeeded, else what went wrong."""
    try:
        async with http.post(target.url, data=target.body, headers=headers) as response:
            if response.status != 200:
                return f"HTTP {response.status}: {(await response.text())[:300]}"
            # Streams are read as they come (every chunk), not buffered by the client.
            async for _chunk in response.content.iter_any():
                pass
            return None
    except (TimeoutError, aiohttp.ClientError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def _measure(
    target: Target, clients: int, seconds: float, warmup_s: float, stream: bool
) -> Measurement:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    latencies: list[float] = []
    errors: list[str] = []
    warm_ok = [0]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        headers = [
            {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {target.keys[i % len(target.keys)]}",
            }
            for i in range(clients)
        ]
        warm_until = time.perf_counter() + warmup_s
        stop_at = warm_until + seconds

        async def client(i: int) -> None:
            # Warm-up: connections opened, caches filled, the proxy's lazy paths taken, all untimed.
            while time.perf_counter() < warm_until:
                if await _send(http, target, headers[i]) is None:
                    warm_ok[0] += 1
            while time.perf_counter() < stop_at:
                started = time.perf_counter()
                error = await _send(http, target, headers[i])
                if error is None:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors.append(error)

        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.perf_counter() - warm_until
    return _measurement(clients, stream, elapsed, latencies, errors, warm_ok[0])


def measure(target: Target, clients: int, seconds: float, warmup_s: float, stream: bool) -> Measurement:
    """`clients` closed-loop clients on `target` for `seconds` after `warmup_s` of untimed traffic."""
    return asyncio.run(_measure(target, clients, seconds, warmup_s, stream))


async def measure_while(
    target: Target, clients: int, warmup_s: float, work: Callable[[], Awaitable[T]], stream: bool = False,
    starts: list[float] | None = None,
) -> tuple[Measurement, T]:
    """`clients` closed-loop clients on `target` for as long as `work()` runs: `warmup_s` of untimed
    traffic, then `work()` is started and every call that starts before it returns is timed. Returns the
    measurement (its `seconds`: how long `work()` ran) and what `work()` returned; `starts`, when given,
    gets the `time.perf_counter()` at which each timed successful call started, in the order of its
    latencies."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    latencies: list[float] = []
    errors: list[str] = []
    warm_ok = [0]
    timing = asyncio.Event()
    done = asyncio.Event()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        headers = [
            {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {target.keys[i % len(target.keys)]}",
            }
            for i in range(clients)
        ]

        async def client(i: int) -> None:
            while not done.is_set():
                timed = timing.is_set()
                started = time.perf_counter()
                error = await _send(http, target, headers[i])
                if not timed:
                    warm_ok[0] += int(error is None)
                elif error is None:
                    latencies.append(time.perf_counter() - started)
                    if starts is not None:
                        starts.append(started)
                else:
                    errors.append(error)

        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        try:
            await asyncio.sleep(warmup_s)
            timing.set()
            began = time.perf_counter()
            result = await work()
            elapsed = time.perf_counter() - began
        finally:
            done.set()
            await asyncio.gather(*tasks)  # each client ends with the call it has in flight
    return _measurement(clients, stream, elapsed, latencies, errors, warm_ok[0]), result


def _measurement(
    clients: int, stream: bool, elapsed: float, latencies: list[float], errors: list[str], warm_ok: int
) -> Measurement:
    """A load's figures from its timed calls (`latencies` in seconds) and untimed successful ones."""
    return Measurement(clients, stream, elapsed, len(latencies), len(errors), len(latencies) + warm_ok,
                       np.array(latencies) * 1000.0, errors[0] if errors else None)
