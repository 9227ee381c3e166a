"""The proxy's raw JSON purge (`proxy.privacy.raw_json_retention_s`): while the services live, every
`purge_interval_s` the JSON of completions past retention is replaced by a marker (storage/retention.py).
Several proxies on one database may all run it: a row purged twice is purged once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from proxy.privacy import PrivacyConfig
from storage.engine import SessionFactory
from storage.retention import purge_raw_json

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def purging(session_factory: SessionFactory, config: PrivacyConfig) -> AsyncIterator[None]:
    """Purge past-retention JSON in the background while inside (nothing without a retention)."""
    retention_s = config.raw_json_retention_s
    if retention_s is None:
        yield
        return
    task = asyncio.create_task(
        _purge_forever(session_factory, config, retention_s), name="flywheel-json-purge"
    )
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _purge_forever(session_factory: SessionFactory, config: PrivacyConfig, retention_s: float) -> None:
    while True:
        try:
            purged = await purge_raw_json(session_factory, retention_s, config.purge_batch)
        except Exception as exc:  # a task boundary: a failed pass (the database away) is tried again later
            logger.warning("purging raw JSON past retention failed: %s", exc)
        else:
            if purged:
                logger.info("purged the raw JSON of %d completion(s) past retention", purged)
        await asyncio.sleep(config.purge_interval_s)
