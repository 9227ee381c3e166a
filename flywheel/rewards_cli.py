"""`flywheel rewards`: run reward hook jobs in a process of their own (`run`), or list the hooks (`hooks`).

Any number of `flywheel rewards run` processes may share one database (Postgres, for more than one
machine): each claims jobs with leases, so none runs a job another holds. Set `rewards.runner.in_proxy:
false` so the proxy leaves the jobs to them. Metrics are served on `--metrics-port` when given, on
`--metrics-host` (loopback by default).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import textwrap

from flywheel.config import FlywheelConfig

logger = logging.getLogger(__name__)


def list_hooks() -> str:
    """The built-in hooks, one per line: name, level, summary."""
    from rewards.hooks.registry import HookRegistry

    factories = HookRegistry.built_in().factories()
    width = max(len(factory.name) for factory in factories)
    lines = [f"{factory.name.ljust(width)}  {factory.level:<7}  {factory.summary}" for factory in factories]
    lines.append(textwrap.fill("A user hook is named `package.module:function` (TRL reward functions, verl "
                               "compute_score and AReaL reward_fn are recognised by their parameters).", 100))
    return "\n".join(lines)


async def run_hooks(
    config: FlywheelConfig, metrics_port: int | None = None, metrics_host: str = "127.0.0.1"
) -> int:
    """Run hook jobs from `config.storage` until SIGINT or SIGTERM; running jobs are handed back."""
    from prometheus_client import start_http_server

    from proxy.services import check_hooks
    from rewards.hooks.registry import HookRegistry
    from rewards.metrics import HookMetrics
    from rewards.runner import HookRunner
    from storage.engine import create_engine, create_sessionmaker

    registry = HookRegistry.built_in()
    check_hooks(registry, config.rewards)
    metrics = HookMetrics()
    if metrics_port is not None:
        start_http_server(metrics_port, addr=metrics_host, registry=metrics.registry)
    engine = create_engine(config.storage)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    runner = HookRunner(create_sessionmaker(engine), registry, config.rewards.runner, metrics=metrics)
    logger.info("reward hook runner: %d jobs at once, %d worker process(es)",
                config.rewards.runner.concurrency, config.rewards.runner.workers)
    try:
        await runner.run(stop)
    finally:
        await engine.dispose()
    return 0
