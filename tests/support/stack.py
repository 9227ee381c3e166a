"""Helpers for tests that run the whole stack (`flywheel up`'s processes) on loopback ports."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

from flywheel.config import ONLINE_OVERRIDES, load_config
from flywheel.stack import Stack, start_stack
from serving.threaded_server import free_port
from tests.support.databases import storage_config

T = TypeVar("T")

ENGINE_PORTS = 3
"""Ports from `serving.port` the engines may take: the serving workers', then an eval engine's."""


def free_port_block(count: int) -> int:
    """A port p such that p … p + count - 1 are all free now. Engines listen on consecutive ports
    (`serving.port + i`), and a single free port's neighbour is often some connection's local port, so
    the block is drawn below the range the OS takes local ports from (32768 and up on Linux), from a
    slice of it of each xdist worker's own, so that stacks of tests running side by side, which probe
    their ports seconds before binding them, never draw the same ones."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    low = 20_000 + (int(worker) % 4 if worker.isdigit() else 0) * 3_000
    while True:
        base = random.randrange(low, low + 3_000 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base


def stack_overrides(db_url: str, model_dir: Path, run_dir: Path, **extra: Any) -> list[str]:
    """Config overrides for a small, fast stack on free ports with the tiny model."""
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Unix socket paths must stay short
    key_secret = storage_config(db_url).key_secret
    settings = {
        "storage.url": db_url,
        **({} if key_secret is None else {"storage.key_secret": key_secret.get_secret_value()}),
        "serving.model": str(model_dir),
        "serving.port": free_port_block(ENGINE_PORTS),
        "serving.cpu.num_threads": 1,
        "proxy.port": free_port(),
        "proxy.key_cache_ttl_s": 0,
        "proxy.finalizer.sweep_interval_s": 0.5,
        "run.dir": str(run_dir),
        "trainer.num_threads": 1,
        "trainer.poll_interval_s": 0.2,
        "trainer.ray.temp_dir": ray_dir,
        "trainer.ray.num_cpus": 2,
        **extra,
    }
    return [f"{key}={value}" for key, value in settings.items()]


@contextmanager
def running_stack(overrides: list[str], *, trainer: bool = True, online: bool = False) -> Iterator[Stack]:
    """`flywheel up`'s processes; `online` as `flywheel up --online` (its overrides come first)."""
    if online:
        overrides = [*ONLINE_OVERRIDES, *overrides]
    config = load_config(None, overrides)
    stack = asyncio.run(start_stack(config, None, overrides, trainer=trainer, online=online))
    try:
        yield stack
    finally:
        stack.stop()


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str, stack: Stack | None = None) -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if stack is not None and (dead := stack.dead()) is not None:
            raise AssertionError(f"{dead.name} died while waiting for {what}:\n{dead.tail(40)}")
        time.sleep(0.2)
    logs = "" if stack is None else "\n".join(f"--- {c.name}\n{c.tail(15)}" for c in stack.children)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")


def rest(root_url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=root_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
