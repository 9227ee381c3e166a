"""Does one very large prompt stall everyone else? Small chat calls (one client, one after another) are
timed against `flywheel proxy` (the tiny model, SQLite, the benchmark's scripted worker), alone and while
another client sends large prompts back to back (one user message of `--large-chars` characters, new
text each time so no render is cached, within `proxy.limits.max_prompt_chars` and a context large
enough to accept it).

Three proxies: the default without the large client (the baseline); the default with it; and, with it,
tokenization kept on the event loop (`proxy.tokenize_in_thread_chars` and `proxy.parse_in_thread_bytes`
past any prompt), which is what a tokenizer holding the GIL did to the loop even from a worker thread.
With the large client, small calls go on until `--large-prompts` large prompts were answered.

    .venv/bin/python benchmarks/large_prompt_stall.py [--large-chars 2000000] [--large-prompts 3]
        [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import string
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.overhead import stacks

BIG_CONTEXT = "proxy.context_length=16777216"
_MIN_CALLS = 20  # small calls timed at least, however long the large prompts take
ON_THE_LOOP = ("proxy.tokenize_in_thread_chars=1000000000", "proxy.parse_in_thread_bytes=1000000000")


@dataclass(frozen=True)
class Row:
    setup: str
    large_client: bool
    small: list[float]
    """Latency of each small call, in ms."""
    large: list[float]
    """Latency of each large prompt answered meanwhile, in ms."""

    def percentile(self, q: float) -> float:
        ordered = sorted(self.small)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _document(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    return " ".join(rng.choices(words, k=chars // 5))[:chars]


async def _measure(
    base_url: str, keys: tuple[str, ...], calls: int, large_chars: int | None, large_prompts: int
) -> tuple[list[float], list[float]]:
    """(small-call latencies, large-prompt latencies) in ms: `calls` small calls alone, or, with a large
    client, as many as it takes for `large_prompts` large prompts to be answered."""
    small_key, large_key = keys[0], keys[1]
    url = f"{base_url}/v1/chat/completions"
    small_ms: list[float] = []
    large_ms: list[float] = []
    done = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as small_http, \
            aiohttp.ClientSession(timeout=timeout) as large_http:

        async def post(http: aiohttp.ClientSession, key: str, content: str) -> float:
            body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            started = time.perf_counter()
            async with http.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
            return (time.perf_counter() - started) * 1000

        async def large_client() -> None:
            assert large_chars is not None
            document = 0
            while not done.is_set():
                text = _document(large_chars, document)
                document += 1
                large_ms.append(await post(large_http, large_key, text))

        for i in range(10):  # warm-up: first renders, connections
            await post(small_http, small_key, f"Warm-up {i}.")
        background = asyncio.create_task(large_client()) if large_chars else None
        if background is not None:
            await asyncio.sleep(0.5)  # the first large prompt is being read and tokenized
        while (len(small_ms) < calls if background is None
               else len(large_ms) < large_prompts or len(small_ms) < _MIN_CALLS):
            i = len(small_ms)
            small_ms.append(await post(small_http, small_key, f"Small call {i}: what is {i} + {i}?"))
        done.set()
        if background is not None:
            await background
    return small_ms, large_ms


def run(calls: int, large_chars: int, large_prompts: int) -> list[Row]:
    setups = [("default", (), False), ("default", (), True),
              ("tokenized on the event loop", ON_THE_LOOP, True)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="large-prompt-stall-") as scratch:
        logs = Path(scratch)
        with stacks.worker(logs) as worker:
            for name, settings, with_large in setups:
                with stacks.sqlite_database() as db_url, stacks.flywheel_proxy(
                    logs, db_url, worker.url, 2, settings=(BIG_CONTEXT, *settings)
                ) as proxy:
                    small, large = asyncio.run(_measure(proxy.url, proxy.keys, calls,
                                                        large_chars if with_large else None, large_prompts))
                row = Row(name, with_large, small, large)
                print(f"  {name:28} large client: {'yes' if with_large else 'no ':3}  small p50 "
                      f"{row.percentile(0.5):8.1f} ms  p99 {row.percentile(0.99):8.1f} ms", flush=True)
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=300, help="small calls timed without the large client")
    parser.add_argument("--large-prompts", type=int, default=3, help="large prompts answered per row")
    parser.add_argument("--large-chars", type=int, default=2_000_000, help="characters of each large prompt")
    args = parser.parse_args(argv)
    rows = run(args.calls, args.large_chars, args.large_prompts)
    print(f"\nSmall calls (one client, one at a time) with and without another client sending "
          f"{args.large_chars:,}-character prompts back to back:\n")
    print("| proxy | large prompts | small calls | small p50 ms | small p99 ms | small max ms "
          "| large prompt p50 ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        large = f"{statistics.median(row.large):.0f}" if row.large else "-"
        print(f"| {row.setup} | {len(row.large)} | {len(row.small)} | {row.percentile(0.5):.1f} | "
              f"{row.percentile(0.99):.1f} | {max(row.small):.1f} | {large} |")


if __name__ == "__main__":
    main()
