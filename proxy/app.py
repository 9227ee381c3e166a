"""The proxy's FastAPI app: OpenAI API, RL control API, /metrics and /health, OpenAI-shaped errors and an
`x-request-id` on every answer. State is built in the lifespan (see proxy/services.py)."""

from __future__ import annotations

import logging
import random
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.balancer import health_checks
from proxy.config import ProxyConfig
from proxy.errors import REQUEST_ID_HEADER, install_error_handlers
from proxy.hot_routes import HotRoute, ProxyApp
from proxy.openai_routes import build_openai_router, hot_routes
from proxy.probes import build_probe_router
from proxy.rl_routes import build_rl_router
from proxy.services import ProxyServices, build_services, get_services
from serving.config import ServingConfig
from storage.config import StorageConfig

logger = logging.getLogger(__name__)

_MAX_CLIENT_REQUEST_ID = 128
_RL_PREFIX = "/rl/"


def create_proxy_app(proxy: ProxyConfig, storage: StorageConfig, serving: ServingConfig) -> ProxyApp:
    """The proxy app; its services (database, tokenizer, workers, recorder) start with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with build_services(proxy, storage, serving) as services:
            app.state.services = services
            configure_routing(services, proxy)
            async with health_checks(services.balancer, proxy.health_check_interval_s):
                yield

    telemetry = proxy.otel_telemetry
    app = ProxyApp(
        title="Flywheel proxy", version="0.1.0", lifespan=lifespan,
        telemetry={"tracing": telemetry, "metrics": telemetry, "logs": telemetry},
    )
    install_error_handlers(app)
    app.add_middleware(RequestContextMiddleware, log_requests=proxy.log_requests)
    for path, endpoint in hot_routes().items():
        app.add_hot_route(path, RequestContextMiddleware(HotRoute(path, endpoint), proxy.log_requests))
    app.include_router(build_openai_router())
    app.include_router(build_probe_router())
    app.include_router(build_rl_router())
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", health, methods=["GET"], include_in_schema=False)
    return app


def configure_routing(services: ProxyServices, proxy: ProxyConfig) -> None:
    """The balancer's sticky-routing and resume settings from config, and the tokenizer's decode (to
    rejoin text a resumed generation split inside a character)."""
    balancer = services.balancer
    balancer.policy.sticky_slack = proxy.sticky_slack
    balancer.policy.sticky_sessions_max = proxy.sticky_sessions_max
    balancer.policy.resume_max_attempts = proxy.resume_max_attempts
    balancer.policy.resume_timeout_s = proxy.resume_timeout_s
    balancer.decode = services.tokenizer.decode


async def metrics(services: Annotated[ProxyServices, Depends(get_services)]) -> Response:
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def health() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


class RequestContextMiddleware:
    """Pure ASGI (no per-request task): gives each request an id (the client's `x-request-id` if it
    sent a sane one), returns it as `x-request-id`, counts and times the request per route, and logs
    it when asked."""

    def __init__(self, app: ASGIApp, log_requests: bool = False) -> None:
        self.app = app
        self.log_requests = log_requests
        # Request ids need to be unique, not unguessable: a seeded PRNG instead of an os.urandom
        # syscall per request (measured ~4% of the proxy's CPU per request under load).
        self._ids = random.Random(secrets.randbits(128))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(scope) or f"req_{self._ids.getrandbits(96):024x}"
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER.encode(), request_id.encode())
        started = time.perf_counter()
        status = 500

        changes_keys = scope["method"] == "POST" and scope["path"].startswith(_RL_PREFIX)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
                if changes_keys and status < 400:
                    # The call has committed (a session ended, a key rebound); before its caller can
                    # act on the answer, no cached key may outlive what it changed.
                    _clear_key_cache(scope)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._observe(scope, status, time.perf_counter() - started, request_id)

    def _observe(self, scope: Scope, status: int, elapsed: float, request_id: str) -> None:
        route = scope.get("route")
        label = getattr(route, "path", None) or "unmatched"
        services: Any = getattr(scope["app"].state, "services", None)
        if services is not None:
            services.metrics.requests.labels(label, str(status)).inc()
            services.metrics.latency.labels(label).observe(elapsed)
        if self.log_requests:
            logger.info("%s %s -> %d in %.1f ms (request %s)", scope["method"], scope["path"], status,
                        elapsed * 1000, request_id)


def _clear_key_cache(scope: Scope) -> None:
    services: Any = getattr(scope["app"].state, "services", None)
    if services is not None:
        services.key_cache.clear()


def _request_id(scope: Scope) -> str | None:
    """The client's own x-request-id, if it sent a sane one."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and 0 < len(value) <= _MAX_CLIENT_REQUEST_ID:
            return value.decode("latin-1")
    return None
