"""Everything stateful the proxy's routes share, built in the app's lifespan (never at import) and hung
on `app.state.services`; routes get it with the `get_services` dependency."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.auth import KeyCache
from proxy.balancer import Balancer
from proxy.config import ProxyConfig
from proxy.conversations import ConversationIndex, IndexingRecorder
from proxy.metrics import ProxyMetrics
from proxy.tokenize import ChatTokenizer, load_chat_tokenizer
from rewards.finalizer import SessionFinalizer
from serving.client import WorkerPool
from serving.config import ServingConfig
from serving.models.loading import default_cache_dir, resolve_model_dir
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 30.0


@dataclass(eq=False)
class ProxyServices:
    """The proxy's shared state: database, recorder, tokenizer, workers, metrics."""

    config: ProxyConfig
    storage_config: StorageConfig
    serving_config: ServingConfig
    engine: AsyncEngine
    session_factory: SessionFactory
    recorder: IndexingRecorder
    tokenizer: ChatTokenizer
    pool: WorkerPool
    balancer: Balancer
    served_model_name: str
    metrics: ProxyMetrics
    key_cache: KeyCache
    conversations: ConversationIndex
    """Each session's conversation tree, for token-exact multi-turn prompts (proxy/conversations.py)."""
    finalizer: SessionFinalizer | None = None
    """Turns ended, rewarded sessions into trajectories; started and stopped by the RL router's
    lifespan (proxy/rl_routes.py), which runs inside this app's."""
    started_at: int = field(default_factory=lambda: int(time.time()))
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks that outlive a request (a stream's recording after the client left); awaited at shutdown."""

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` in the background, keeping it alive until it ends or the app shuts down."""
        task = asyncio.create_task(coro, name=name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task


async def get_services(request: Request) -> ProxyServices:
    """FastAPI dependency: the services of the app serving this request. (Async: FastAPI would run a
    plain function in its thread pool, a thread hop per request.)"""
    services: ProxyServices = request.app.state.services
    return services


def worker_urls(serving: ServingConfig) -> list[str]:
    """`serving.worker_urls`, else http://{host}:{port + i} for each of the `num_workers` workers."""
    return serving.resolved_worker_urls()


def configured_context_length(proxy: ProxyConfig, serving: ServingConfig) -> int | None:
    """The context length set in config (proxy's first, then the serving backend's), if any."""
    if proxy.context_length is not None:
        return proxy.context_length
    if serving.backend == "cpu":
        return serving.cpu.context_length
    return serving.sglang.context_length


@asynccontextmanager
async def build_services(
    proxy: ProxyConfig, storage: StorageConfig, serving: ServingConfig
) -> AsyncIterator[ProxyServices]:
    """Open the database, load the tokenizer, connect the workers and start the recorder; undo it all
    on exit (after in-flight recordings finish)."""
    metrics = ProxyMetrics()
    cache_dir = serving.cache_dir if serving.cache_dir is not None else default_cache_dir()
    model_dir = await asyncio.to_thread(resolve_model_dir, serving.model, cache_dir)
    tokenizer = await asyncio.to_thread(
        load_chat_tokenizer, model_dir, configured_context_length(proxy, serving)
    )
    engine = create_engine(storage)
    session_factory = create_sessionmaker(engine)
    # The balancer fails over to the next worker itself, so a dead worker costs one refused connect.
    pool = WorkerPool(serving.client.model_copy(update={"max_retries": 0}))
    clients = [pool.client(url) for url in worker_urls(serving)]
    conversations = ConversationIndex(
        session_factory, proxy.conversation_sessions_max, proxy.conversation_nodes_max
    )
    recorder = IndexingRecorder(session_factory, proxy.record_batch_max, metrics, conversations)
    recorder.start()
    services = ProxyServices(
        config=proxy,
        storage_config=storage,
        serving_config=serving,
        engine=engine,
        session_factory=session_factory,
        recorder=recorder,
        tokenizer=tokenizer,
        pool=pool,
        balancer=Balancer(clients, metrics, proxy.worker_failure_cooldown_s),
        served_model_name=serving.served_model_name or serving.model,
        metrics=metrics,
        key_cache=KeyCache(proxy.key_cache_ttl_s),
        conversations=conversations,
    )
    logger.info(
        "proxy serving %s (context %d tokens) through %d worker(s): %s",
        services.served_model_name, tokenizer.context_length, len(clients),
        ", ".join(c.base_url for c in clients),
    )
    if proxy.gc_freeze:
        # The tokenizer and the libraries loaded by now are ~285k long-lived objects; frozen, no
        # full collection walks them again (unfrozen, a full collection took 150-300 ms here,
        # every request in flight stalled meanwhile).
        gc.collect()
        gc.freeze()
    try:
        yield services
    finally:
        await _shutdown(services)


async def _shutdown(services: ProxyServices) -> None:
    if services.background:
        _done, pending = await asyncio.wait(set(services.background), timeout=_SHUTDOWN_GRACE_S)
        for task in pending:
            logger.warning("cancelling %s at shutdown", task.get_name())
            task.cancel()
    await services.recorder.stop()
    await services.pool.close()
    await services.engine.dispose()
