"""Reward hooks for the metrics tests, named `tests.support.metrics_hooks:<function>` in hook specs. Both are
async, so they run on the runner's own event loop and never need its process pool."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rewards.hooks.contract import SessionInput

_GATE_WAIT_S = 60.0


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + _GATE_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


async def held_until_gate(session: SessionInput) -> float:
    """Holds its job in flight until the file its session's metadata names (`gate`) exists."""
    await asyncio.to_thread(_wait_for, Path(session.metadata["gate"]))
    return 1.0


async def broken(session: SessionInput) -> float:
    raise RuntimeError("this grader is broken")
