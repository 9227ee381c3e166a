"""The proxy's FastAPI app: the OpenAI surface (proxy/openai/), Anthropic's Messages API (proxy/anthropic/),
the RL control API (proxy/rl/), /metrics and /health, OpenAI-shaped errors (Anthropic-shaped on the
Messages API's routes) and an `x-request-id` on every answer. Its state is built once, in its lifespan
(proxy/services.py)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.anthropic.routes import build_anthropic_router
from proxy.anthropic.routes import hot_routes as anthropic_hot_routes
from proxy.config import ProxyConfig
from proxy.dashboard.routes import build_dashboard_router
from proxy.errors import install_error_handlers
from proxy.hot_routes import HotRoute, ProxyApp
from proxy.openai.probes import build_probe_router
from proxy.openai.routes import build_openai_router, hot_routes
from proxy.request_context import RequestContextMiddleware
from proxy.rl.routes import build_rl_router
from proxy.services import ProxyServices, build_services, get_services
from rewards.config import RewardsConfig
from serving.config import ServingConfig
from storage.config import StorageConfig

logger = logging.getLogger(__name__)


def create_proxy_app(
    proxy: ProxyConfig, storage: StorageConfig, serving: ServingConfig, rewards: RewardsConfig | None = None
) -> ProxyApp:
    """The proxy app; its services (database, tokenizer, workers, recorder, finalizer, reward hooks) start
    with it."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with build_services(proxy, storage, serving, rewards) as services:
            app.state.services = services
            yield

    telemetry = proxy.otel_telemetry
    app = ProxyApp(
        title="Flywheel proxy", version="0.1.0", lifespan=lifespan,
        telemetry={"tracing": telemetry, "metrics": telemetry, "logs": telemetry},
    )
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, log_requests=proxy.log_requests)
    for path, endpoint in {**hot_routes(), **anthropic_hot_routes()}.items():
        app.add_hot_route(path, RequestContextMiddleware(HotRoute(path, endpoint), proxy.log_requests))
    app.include_router(build_openai_router())
    app.include_router(build_anthropic_router())
    app.include_router(build_probe_router())
    app.include_router(build_rl_router())
    app.include_router(build_dashboard_router())
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", health, methods=["GET"], include_in_schema=False)
    return app


async def metrics(services: Annotated[ProxyServices, Depends(get_services)]) -> Response:
    """Prometheus text; gauges of queues are read now rather than on every request."""
    services.metrics.record_queue.set(services.recorder.backlog)
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def health() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")
