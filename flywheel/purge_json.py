"""`flywheel db purge-json [--older-than SECONDS]`: purge the raw request/response JSON past retention
once, as the proxy does every `proxy.privacy.purge_interval_s` (storage/retention.py), and say how many
completions it purged.

A first purge of a large database can take a while, so on a terminal a bar counts the completions
purged, `proxy.privacy.purge_batch` per transaction.
"""

from __future__ import annotations

import asyncio
import sys

from flywheel.config import FlywheelConfig
from flywheel.progress import progress_bar
from storage.engine import create_engine, create_sessionmaker
from storage.retention import count_purgeable, purge_raw_json


def purge_json(config: FlywheelConfig, older_than_s: float | None, *, progress: bool | None = None) -> int:
    """Purge once with `older_than_s` (default: the configured retention); the exit status. `progress`:
    the bar on stderr (None: only on a terminal)."""
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
        bar = progress_bar(None, desc="purge-json", unit="completions", enabled=progress)
        try:
            session_factory = create_sessionmaker(engine)
            if not bar.disable:  # counting is a query of its own: only for a bar someone sees
                bar.reset(total=await count_purgeable(session_factory, retention_s))
            return await purge_raw_json(
                session_factory, retention_s, privacy.purge_batch, on_batch=bar.update
            )
        finally:
            bar.close()
            await engine.dispose()

    purged = asyncio.run(run())
    print(f"purged the raw JSON of {purged} completion(s)")
    return 0
