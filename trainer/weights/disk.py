"""Push a checkpoint to every serving worker with `/update_weights_from_disk` (SGLang and the CPU engine).

sglang-router does not forward weight updates, so each worker is told itself, all at once. Without a
pause, SGLang's writer lock makes the update wait for in-flight requests and holds new ones back until
it is done; with `pause_mode`, generation is paused first and continued after, whatever happened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import Any

from serving.client import SGLangClient
from trainer.config import WeightPushConfig

logger = logging.getLogger(__name__)

INITIAL_WEIGHT_VERSION = "default"
"""What SGLang reports as `weight_version` before any update: policy version 0."""


class WeightPushError(RuntimeError):
    """At least one worker did not load the checkpoint; the message has each worker's own answer."""


def weight_version_label(version: int) -> str:
    """The `weight_version` string of a policy version: "default" for 0, else the number."""
    return INITIAL_WEIGHT_VERSION if version == 0 else str(version)


async def push_weights(
    clients: Sequence[SGLangClient], checkpoint_path: str, version: int, config: WeightPushConfig
) -> float:
    """Make every worker serve `checkpoint_path` as `version`; returns the seconds it took.
    Raises WeightPushError naming each failed worker and its message (workers that succeeded keep the
    new weights; the caller must not record the version as pushed)."""
    started = time.perf_counter()
    label = weight_version_label(version)
    try:
        if config.pause_mode is not None:
            await on_all_workers(clients, "pause", [c.pause_generation(config.pause_mode) for c in clients])
        flush = config.flush_cache
        loads = [c.update_weights_from_disk(checkpoint_path, label, flush_cache=flush) for c in clients]
        await on_all_workers(clients, f"loading {checkpoint_path} as version {label}", loads)
    finally:
        if config.pause_mode is not None:  # also after a failed pause: continuing is harmless
            await on_all_workers(clients, "continue", [c.continue_generation() for c in clients])
    elapsed = time.perf_counter() - started
    logger.info(
        "pushed %s as version %s to %d worker(s) in %.2f s", checkpoint_path, label, len(clients), elapsed
    )
    return elapsed


async def on_all_workers(
    clients: Sequence[SGLangClient], what: str, calls: Sequence[Awaitable[dict[str, Any]]]
) -> None:
    """Await `calls`, one per worker of `clients`, all at once; raise WeightPushError naming every worker
    whose call failed or answered `success: false` (`what` says what was asked of them)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    failures = failed_parties([c.base_url for c in clients], results)
    if failures:
        raise WeightPushError(
            f"{what} failed on {len(failures)} of {len(clients)} worker(s): " + "; ".join(failures)
        )


def failed_parties(parties: Sequence[str], results: Sequence[Any]) -> list[str]:
    """`party: message` for each of `parties` whose result (from `asyncio.gather(...,
    return_exceptions=True)`) is an exception or a `success: false` answer. Cancellation and other
    BaseExceptions are not a party's answer: they are raised."""
    failures = []
    for party, result in zip(parties, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result
            failures.append(f"{party}: {result}")
        elif isinstance(result, dict) and result.get("success") is False:
            failures.append(f"{party}: {result.get('message', result)}")
    return failures


async def served_versions(clients: Sequence[SGLangClient]) -> dict[str, str]:
    """Each worker's current `weight_version` (from `/model_info`), by base URL."""
    infos = await asyncio.gather(*(c.model_info() for c in clients))
    return {c.base_url: str(info.get("weight_version")) for c, info in zip(clients, infos, strict=True)}
