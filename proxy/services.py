"""Everything stateful the proxy's routes share, built once in the app's lifespan (never at import) by
`build_services`, fully wired, and never changed afterwards; routes get it with the `get_services`
dependency (or `request.app.state.services` on the hot routes).

The parts, and what each is given (none of them sees this container):
- the database (`engine`, `session_factory`; checked to be at this Flywheel's schema), `key_hasher`
  (how API keys are stored) and the `tokenizer` of the served model;
- `balancer`: the workers, routed by session, with the routing policy and the tokenizer's decode;
- `conversations`: each session's conversation tree (proxy/conversations/), and `prompter`, which
  builds a call's prompt from it with the tokenizer and metrics;
- `recorder`: group commit of completions (their JSON redacted as `proxy.privacy` says), then the
  conversation index and the metrics learn them;
- `finalizer`: turns ended, rewarded sessions into trajectories (rewards/finalizer.py), sweeping in
  the background while the services live; it waits for a session's `calls` still in flight;
- `database`: the circuit that refuses new work with 503 while the database is unreachable;
- `limiter`: each key's rate limit and daily token quota (proxy/rate_limits.py);
- `hooks`, `hook_runner`: the reward hooks sessions may name, and the runner that labels ended sessions
  with them in this process (rewards/runner.py), unless `flywheel rewards` processes do;
- `background`: tasks that outlive a request (a stream's recording after its client left), awaited at
  shutdown; `health_checks` of the workers, and the purge of raw JSON past `proxy.privacy`'s retention,
  run while the services live.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.auth import KeyCache
from proxy.config import ProxyConfig
from proxy.conversations.index import ConversationIndex
from proxy.conversations.prompt import Prompter
from proxy.database import DatabaseCircuit
from proxy.metrics import ProxyMetrics
from proxy.rate_limits import KeyLimiter
from proxy.recording.indexing import IndexingRecorder
from proxy.recording.redaction import Redactor
from proxy.recording.retention import purging
from proxy.sessions import NewConversations, SessionCalls
from proxy.tokenize import ChatTokenizer, load_chat_tokenizer
from proxy.workers.routing import Balancer, RoutingPolicy, health_checks
from rewards.config import RewardsConfig
from rewards.finalizer import FinalizerMetrics, SessionFinalizer
from rewards.hooks.registry import HookRegistry
from rewards.metrics import HookMetrics
from rewards.runner import HookRunner
from serving.client import WorkerPool
from serving.config import ServingConfig
from serving.models.loading import default_cache_dir, resolve_model_dir
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.keys import KeyHasher, load_key_hasher
from storage.migrate import ensure_schema

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 30.0


@dataclass(eq=False)
class Background:
    """Tasks that outlive the request that started them; `drain` waits for them at shutdown."""

    tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` in the background, keeping it alive until it ends or the app shuts down."""
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def drain(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the running tasks, then cancel what is left."""
        if not self.tasks:
            return
        _done, pending = await asyncio.wait(set(self.tasks), timeout=grace_s)
        for task in pending:
            logger.warning("cancelling %s at shutdown", task.get_name())
            task.cancel()


@dataclass(frozen=True, eq=False)
class ProxyServices:
    """The proxy's shared state (see the module's docstring for what each part is)."""

    config: ProxyConfig
    engine: AsyncEngine
    session_factory: SessionFactory
    tokenizer: ChatTokenizer
    model_name: str
    """The served model's name, as /v1/models reports it."""
    pool: WorkerPool
    balancer: Balancer
    metrics: ProxyMetrics
    key_cache: KeyCache
    key_hasher: KeyHasher
    """How keys are hashed, with the secret every process on this database shares (storage/keys.py)."""
    conversations: ConversationIndex
    prompter: Prompter
    recorder: IndexingRecorder
    finalizer: SessionFinalizer
    calls: SessionCalls
    database: DatabaseCircuit
    limiter: KeyLimiter
    background: Background
    rewards: RewardsConfig
    hooks: HookRegistry
    """The reward hooks this proxy knows: what sessions may name, checked when they are created."""
    hook_runner: HookRunner | None
    """Runs reward hook jobs in this process (`rewards.runner.in_proxy`), else None."""
    lora_adapter: str | None = None
    """The LoRA adapter every generate request names (`serving.lora_adapter`), if any."""
    started_at: int = field(default_factory=lambda: int(time.time()))
    new_conversations: NewConversations = field(default_factory=NewConversations)


async def get_services(request: Request) -> ProxyServices:
    """FastAPI dependency: the services of the app serving this request. (Async: FastAPI would run a
    plain function in its thread pool, a thread hop per request.)"""
    services: ProxyServices = request.app.state.services
    return services


def configured_context_length(proxy: ProxyConfig, serving: ServingConfig) -> int | None:
    """The context length set in config (proxy's first, then the serving backend's), if any."""
    if proxy.context_length is not None:
        return proxy.context_length
    if serving.backend == "cpu":
        return serving.cpu.context_length
    return serving.sglang.context_length


def routing_policy(proxy: ProxyConfig) -> RoutingPolicy:
    return RoutingPolicy(
        sticky_slack=proxy.sticky_slack, sticky_sessions_max=proxy.sticky_sessions_max,
        resume_max_attempts=proxy.resume_max_attempts, resume_timeout_s=proxy.resume_timeout_s,
    )


def check_hooks(registry: HookRegistry, rewards: RewardsConfig) -> None:
    """The configured hooks resolve (a HookConfigError, naming the nearest valid hook, stops the proxy)."""
    registry.check(rewards.hooks, "session")
    registry.check(rewards.online_hooks, "session")
    registry.check(rewards.group_hooks, "group")


@asynccontextmanager
async def build_services(
    proxy: ProxyConfig, storage: StorageConfig, serving: ServingConfig, rewards: RewardsConfig | None = None
) -> AsyncIterator[ProxyServices]:
    """Open the database, load the tokenizer, connect the workers, start the recorder, the finalizer,
    the reward hook runner and the health checks; undo it all on exit (after in-flight recordings
    finish). A database not at this Flywheel's schema, a missing key secret, or a configured reward hook
    that cannot be used stops it before it serves anything."""
    rewards = rewards or RewardsConfig()
    hooks = await asyncio.to_thread(HookRegistry.built_in)
    check_hooks(hooks, rewards)
    await asyncio.to_thread(ensure_schema, storage, upgrade_sqlite=False)
    key_hasher = await asyncio.to_thread(load_key_hasher, storage)
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
    clients = [pool.client(url) for url in serving.resolved_worker_urls()]
    balancer = Balancer(clients, metrics, proxy.worker_failure_cooldown_s, routing_policy(proxy),
                        tokenizer.decode)
    conversations = ConversationIndex(
        session_factory, proxy.conversation_sessions_max, proxy.conversation_nodes_max,
        proxy.ephemeral_messages,
    )
    background = Background()
    database = DatabaseCircuit(engine, metrics, proxy.database_retry_after_s, proxy.database_probe_interval_s)
    calls = SessionCalls()
    finalizer = SessionFinalizer(session_factory, proxy.finalizer, calls, FinalizerMetrics(metrics.registry))
    hook_runner = None
    if rewards.runner.in_proxy:
        hook_runner = HookRunner(
            session_factory, hooks, rewards.runner, metrics=HookMetrics(metrics.registry),
            on_settled=lambda ids: _finalize_when_ready(finalizer, ids),
        )
    services = ProxyServices(
        config=proxy,
        engine=engine,
        session_factory=session_factory,
        tokenizer=tokenizer,
        model_name=serving.served_model_name or serving.model,
        pool=pool,
        balancer=balancer,
        metrics=metrics,
        key_cache=KeyCache(proxy.key_cache_ttl_s),
        key_hasher=key_hasher,
        conversations=conversations,
        prompter=Prompter(conversations, tokenizer, metrics, background.spawn, proxy.tokenize_in_thread_chars,
                          proxy.drift_check_every),
        recorder=IndexingRecorder(session_factory, proxy.record_batch_max, metrics, conversations,
                                  proxy.record_retry_s, database.failed,
                                  Redactor(proxy.privacy, proxy.tokenize_in_thread_chars)),
        finalizer=finalizer,
        calls=calls,
        database=database,
        limiter=KeyLimiter(proxy.rate_limits, session_factory),
        background=background,
        rewards=rewards,
        hooks=hooks,
        hook_runner=hook_runner,
        lora_adapter=serving.lora_adapter,
    )
    logger.info(
        "proxy serving %s (context %d tokens) through %d worker(s): %s",
        services.model_name, tokenizer.context_length, len(clients), ", ".join(c.base_url for c in clients),
    )
    if proxy.gc_freeze:
        # The tokenizer and the libraries loaded by now are long-lived objects; frozen, no full
        # collection walks them again (unfrozen, every request in flight stalls while one does).
        gc.collect()
        gc.freeze()
    async with AsyncExitStack() as stack:
        stack.push_async_callback(engine.dispose)
        stack.push_async_callback(pool.close)
        stack.push_async_callback(database.stop)
        services.recorder.start()
        stack.push_async_callback(services.recorder.stop)
        stack.push_async_callback(background.drain, _SHUTDOWN_GRACE_S)
        await stack.enter_async_context(services.finalizer.running())
        if hook_runner is not None:  # stops (handing its running jobs back) before the finalizer does
            await stack.enter_async_context(hook_runner.running())
        await stack.enter_async_context(services.limiter.tokens.flushing())
        await stack.enter_async_context(purging(session_factory, proxy.privacy))
        await stack.enter_async_context(health_checks(balancer, proxy.health_check_interval_s))
        yield services


def _finalize_when_ready(finalizer: SessionFinalizer, session_ids: Sequence[str]) -> None:
    for session_id in session_ids:
        finalizer.schedule(session_id)
