"""Functions the process-pool tests run in spawned workers (so they must be importable by module path)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def add(a: int, b: int) -> int:
    """The sum, computed in the worker."""
    return a + b


def worker_pid() -> int:
    """The worker's process id."""
    return os.getpid()


def fail(message: str) -> None:
    """Raise ValueError(message) in the worker."""
    raise ValueError(message)


def raise_timeout_error() -> None:
    """Raise the function's own TimeoutError (not a pool timeout)."""
    raise TimeoutError("the function's own timeout")


def sleep_forever(marker: str | None = None) -> None:
    """Touch `marker` (when given), then never return."""
    if marker is not None:
        Path(marker).touch()
    while True:
        time.sleep(60)


def exit_now(code: int) -> None:
    """End the worker at once with exit status `code`, as a crash would."""
    os._exit(code)


def kill_self() -> None:
    """SIGKILL the worker, as the kernel's OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)


def is_imported(module: str) -> bool:
    """Whether `module` is already imported in the worker."""
    return module in sys.modules


def rendezvous(directory: str, name: str, parties: int, deadline_s: float) -> bool:
    """Announce `name` in `directory`, then wait until `parties` names are there: True when they all
    arrived before `deadline_s`, which only happens if that many calls run at the same time."""
    folder = Path(directory)
    (folder / name).touch()
    give_up = time.monotonic() + deadline_s
    while time.monotonic() < give_up:
        if len(list(folder.iterdir())) >= parties:
            return True
        time.sleep(0.01)
    return False


def timed_sleep(seconds: float) -> tuple[float, float]:
    """Sleep `seconds` and return the wall-clock (start, end), comparable across processes."""
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def niceness() -> int:
    """The calling process's nice value."""
    return os.nice(0)
