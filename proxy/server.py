"""Serving the proxy app with uvicorn: `run_proxy` (the `flywheel proxy` entry point, blocking) and
`serve_proxy_in_thread` (the same server on a loopback port in a background thread, for tests and
benchmarks)."""

from __future__ import annotations

import importlib.util
import logging
from contextlib import AbstractContextManager
from typing import Literal

import uvicorn
from fastapi import FastAPI

from proxy.app import create_proxy_app
from proxy.config import ProxyConfig
from rewards.config import RewardsConfig
from serving.config import ServingConfig
from serving.threaded_server import free_port, serve_config_in_thread
from storage.config import StorageConfig

logger = logging.getLogger(__name__)


def _event_loop() -> Literal["uvloop", "asyncio"]:
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def _uvicorn_config(app: FastAPI, host: str, port: int, log_level: str) -> uvicorn.Config:
    # One process: the recorder's group commit and the balancer's counts live in it. No proxy-headers
    # middleware: nothing reads the client's address, and it parsed X-Forwarded-* on every request.
    return uvicorn.Config(
        app, host=host, port=port, loop=_event_loop(), workers=1, access_log=False, log_level=log_level,
        backlog=4096, timeout_keep_alive=30, proxy_headers=False,
    )


def run_proxy(
    proxy_config: ProxyConfig, storage_config: StorageConfig, serving_config: ServingConfig,
    rewards_config: RewardsConfig | None = None,
) -> None:
    """Serve the proxy on `proxy_config.host:port` until interrupted."""
    app = create_proxy_app(proxy_config, storage_config, serving_config, rewards_config)
    logger.info("proxy listening on http://%s:%d (agents use %s)", proxy_config.host, proxy_config.port,
                proxy_config.base_url())
    uvicorn.Server(_uvicorn_config(app, proxy_config.host, proxy_config.port, "info")).run()


def serve_proxy_in_thread(
    proxy_config: ProxyConfig, storage_config: StorageConfig, serving_config: ServingConfig,
    startup_timeout_s: float = 120.0, rewards_config: RewardsConfig | None = None,
) -> AbstractContextManager[str]:
    """Run the proxy under uvicorn in a daemon thread on `proxy_config.host` (port 0 picks a free
    one); yield its base URL (without /v1); shut it down, letting streams finish recording, on exit."""
    host, port = proxy_config.host, proxy_config.port or free_port(proxy_config.host)
    proxy_config = proxy_config.model_copy(update={"port": port})
    app = create_proxy_app(proxy_config, storage_config, serving_config, rewards_config)
    return serve_config_in_thread(_uvicorn_config(app, host, port, "warning"), startup_timeout_s)
