"""The one retry-with-exponential-backoff helper for I/O edges: nothing else in Flywheel retries."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Seconds to wait before retry number `attempt` (0-based): base, 2·base, 4·base, … capped at max_s."""
    return min(base_s * (2**attempt), max_s)


async def retry_with_backoff(
    operation: Callable[[], Awaitable[T]],
    *,
    should_retry: Callable[[BaseException], bool],
    max_retries: int,
    base_delay_s: float,
    max_delay_s: float = 10.0,
    description: str = "operation",
) -> T:
    """Await `operation()`; when it raises an exception for which `should_retry` is true, wait and try again.

    Makes at most `1 + max_retries` attempts. Exceptions that `should_retry` rejects, and the
    exception of the last attempt, propagate unchanged. `operation` is called afresh each time,
    so it must not hold state that an earlier, failed attempt consumed.
    """
    attempt = 0
    while True:
        try:
            return await operation()
        except Exception as exc:
            if attempt >= max_retries or not should_retry(exc):
                raise
            delay = backoff_delay(attempt, base_delay_s, max_delay_s)
            logger.warning(
                "%s failed (%s); retry %d/%d in %.2fs", description, exc, attempt + 1, max_retries, delay
            )
            attempt += 1
            await asyncio.sleep(delay)
