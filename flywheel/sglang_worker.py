"""`flywheel engine` with `serving.backend=sglang`: run a real SGLang server (GPU machines) in the
foreground, as the CPU engine would run, until it exits or is interrupted."""

from __future__ import annotations

import logging
from pathlib import Path

from serving.config import ServingConfig

log = logging.getLogger(__name__)

# Model strings Flywheel resolves to a local folder itself; anything else SGLang loads (a Hub id or a dir).
LOCAL_ONLY = ("demo", "tiny")


def sglang_model_path(serving: ServingConfig) -> str:
    """The --model-path for SGLang: our packaged/built/converted models become their cache folder."""
    if serving.model in LOCAL_ONLY or serving.model.endswith(".gguf"):
        from serving.models.loading import default_cache_dir, resolve_model_dir

        return str(resolve_model_dir(serving.model, serving.cache_dir or default_cache_dir()))
    return serving.model


async def serve_sglang(serving: ServingConfig, port: int, log_dir: Path) -> int:
    """Launch the server, wait for /health, then block until it exits; the caller made `log_dir`."""
    from serving.launcher import launch_sglang_worker

    worker = await launch_sglang_worker(
        sglang_model_path(serving),
        port,
        serving.sglang,
        host=serving.host,
        served_model_name=serving.served_model_name,
        client_config=serving.client,
        log_path=log_dir / f"sglang-{port}.log",
    )
    log.info("SGLang worker ready at %s", worker.url)
    try:
        return await worker.process.wait()
    finally:
        await worker.stop()
