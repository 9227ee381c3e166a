"""`flywheel db purge-json [--older-than SECONDS]`: purge the raw request/response JSON past retention
once, as the proxy does every `proxy.privacy.purge_interval_s` (storage/retention.py), and say how many
completions it purged."""

from __future__ import annotations

import asyncio
import sys

from flywheel.config import FlywheelConfig
from storage.engine import create_engine, create_sessionmaker
from storage.retention import purge_raw_json


def purge_json(config: FlywheelConfig, older_than_s: float | None) -> int:
    """Purge once with `older_than_s` (default: the configured retention); the exit status."""
    privacy = config.proxy.privacy
    retention_s = older_than_s if older_than_s is not None else privacy.raw_json_retention_s
    if retention_s is None:
        print(
            "flywheel: no retention: pass --older-than SECONDS or set proxy.privacy.raw_json_retention_s",
            file=sys.stderr,
        )
        return 2
    if retention_s < 0:
        print(f"flywheel: --older-than must be at least 0, got {retention_s:g}", file=sys.stderr)
        return 2

    async def run() -> int:
        engine = create_engine(config.storage)
        try:
            return await purge_raw_json(create_sessionmaker(engine), retention_s, privacy.purge_batch)
        finally:
            await engine.dispose()

    purged = asyncio.run(run())
    print(f"purged the raw JSON of {purged} completion(s)")
    return 0
