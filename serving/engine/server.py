"""Serving the engine app with uvicorn: `run_engine` (the `flywheel engine` entry point, blocking) and
`serve_in_thread` (the same server on a loopback port in a background thread, for tests and benchmarks)."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

from fastapi import FastAPI

from serving.config import ServingConfig
from serving.engine.app import create_engine_app
from serving.threaded_server import free_port, serve_config_in_thread

logger = logging.getLogger(__name__)

__all__ = ["create_engine_app", "run_engine", "serve_in_thread"]


def run_engine(config: ServingConfig, host: str, port: int, worker_index: int = 0) -> None:
    """Load `config.model` and serve SGLang's native API on host:port until interrupted."""
    import torch
    import uvicorn

    from serving.models.loading import load_model

    if config.cpu.num_threads is not None:
        torch.set_num_threads(config.cpu.num_threads)  # before loading: loading runs torch ops too
    loaded = load_model(config.model, dtype=config.cpu.dtype, cache_dir=config.cache_dir)
    app = create_engine_app(config, loaded, host=host, port=port, worker_index=worker_index)
    logger.info("CPU engine %d listening on http://%s:%d", worker_index, host, port)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                    startup_timeout_s: float = 60.0) -> AbstractContextManager[str]:
    """Run `app` under uvicorn in a daemon thread; yield its base URL; shut it down on exit."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port or free_port(host), log_level="warning")
    return serve_config_in_thread(config, startup_timeout_s, shutdown_timeout_s=30)
