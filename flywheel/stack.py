"""`flywheel up`: the whole system on one machine — engine(s), proxy, reward hook runner and trainer as
child processes sharing one config, the database migrated first and an admin key made for the operator."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from flywheel.config import FlywheelConfig
from flywheel.processes import ChildProcess, flywheel_command, start_child, start_engine

log = logging.getLogger(__name__)

ADMIN_KEY_FILE = "admin_key"
ONLINE_KEY_FILE = "online_key"


class StackError(RuntimeError):
    """A process of the stack failed to start or died; the message carries its last log lines."""


@dataclass
class Stack:
    """The running processes and how to reach them."""

    root_url: str  # the proxy, without /v1
    admin_key: str
    online_key: str | None = None  # `flywheel up --online`: a key for live traffic
    children: list[ChildProcess] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)  # process name → its Prometheus /metrics URL

    def stop(self) -> None:
        # Trainer first (it finishes its step), the hook runner (it hands its jobs back), then the proxy
        # (it drains its recorder), engines last.
        for child in reversed(self.children):
            child.stop()

    def dead(self) -> ChildProcess | None:
        return next((child for child in self.children if not child.alive()), None)


def startup_phases(config: FlywheelConfig, trainer: bool = True) -> int:
    """How many phases `start_stack` tells its `on_phase` of (a start-up bar's total): the database, the
    admin key, the model, each engine it starts, the eval engine of gated promotion, the proxy, the hook
    runner and the trainer."""
    engines = 0 if config.serving.worker_urls else config.serving.num_workers
    evaluates = config.trainer.promotion.enabled and config.online.eval.worker_url is None
    return 3 + engines + int(evaluates) + 2 + int(trainer)


async def start_stack(
    config: FlywheelConfig,
    config_path: str | None,
    overrides: Sequence[str],
    *,
    trainer: bool = True,
    online: bool = False,
    on_phase: Callable[[str], None] | None = None,
) -> Stack:
    """Migrate, convert the model once, start engines (unless `serving.worker_urls`), the eval engine
    of gated promotion (unless `online.eval.worker_url`), the proxy, the reward hook runner and the
    trainer; return once each answers its health check. `online` also makes an online key. `on_phase` is
    told each start-up phase as it begins (`flywheel demo` draws them as a bar)."""
    from serving.models.loading import default_cache_dir, resolve_model_dir
    from serving.threaded_server import free_port
    from storage import migrate

    run_dir, logs = config.run.dir, config.run.dir / "logs"
    run_dir.mkdir(parents=True, exist_ok=True)
    phase = on_phase or (lambda name: None)
    phase("migrate the database")
    await asyncio.to_thread(migrate.upgrade, config.storage.url)
    phase("create the admin key")
    admin_key = await _new_key(config, "admin", ADMIN_KEY_FILE)
    serving = config.serving
    # Convert/build the model here, once, rather than in every engine and the trainer at the same time.
    phase("prepare the model")
    await asyncio.to_thread(resolve_model_dir, serving.model, serving.cache_dir or default_cache_dir())
    stack = Stack(f"http://{config.proxy.host}:{config.proxy.port}", admin_key)
    if online:
        stack.online_key = await _new_key(config, "online", ONLINE_KEY_FILE)
    trainer_overrides = list(overrides)
    try:
        if not serving.worker_urls:
            for index in range(serving.num_workers):
                stack.children.append(start_engine(config_path, overrides, index, logs))
            for child, url in zip(stack.children, serving.resolved_worker_urls(), strict=True):
                phase(f"start {child.name}")
                await wait_healthy(child, f"{url}/health", timeout_s=600)
        if config.trainer.promotion.enabled and config.online.eval.worker_url is None:
            phase("start the eval engine")
            url = await _start_eval_engine(stack, config, config_path, overrides)
            trainer_overrides.append(f"online.eval.worker_url={url}")
        # Reward hooks run in a process of their own: grading never takes the proxy's CPU.
        apart = (*overrides, "rewards.runner.in_proxy=false")
        phase("start the proxy")
        proxy = start_child("proxy", flywheel_command("proxy", config_path, apart), logs)
        stack.children.append(proxy)
        await wait_healthy(proxy, f"{stack.root_url}/health", timeout_s=120)
        phase("start the reward hook runner")
        runner_port = free_port("127.0.0.1")  # its metrics, on loopback
        runner = flywheel_command("rewards", config_path, apart, "run", "--metrics-port", str(runner_port))
        stack.metrics["rewards"] = f"http://127.0.0.1:{runner_port}/metrics"
        stack.children.append(start_child("rewards", runner, logs))
        stack.metrics["proxy"] = f"{stack.root_url}/metrics"
        if not serving.worker_urls:
            for index, url in enumerate(serving.resolved_worker_urls()):
                stack.metrics[f"engine-{index}"] = f"{url}/metrics"
        if trainer:
            stack.metrics["trainer"] = trainer_metrics_url(config, trainer_overrides)
            phase("start the trainer")
            argv = flywheel_command("trainer", config_path, trainer_overrides)
            stack.children.append(start_child("trainer", argv, logs))
    except BaseException:
        stack.stop()
        raise
    return stack


def trainer_metrics_url(config: FlywheelConfig, trainer_overrides: list[str]) -> str:
    """The trainer's metrics URL: on `trainer.metrics_port`, or a free port drawn here (and added to its
    overrides) when that is unset or 0, so that it can be printed."""
    from serving.threaded_server import free_port

    host, port = config.trainer.metrics_host, config.trainer.metrics_port
    if not port:
        port = free_port("127.0.0.1" if host in ("0.0.0.0", "::") else host)
        trainer_overrides.append(f"trainer.metrics_port={port}")
    return f"http://{host}:{port}/metrics"


async def _start_eval_engine(
    stack: Stack, config: FlywheelConfig, config_path: str | None, overrides: Sequence[str]
) -> str:
    """One more engine, serving nobody, that gated promotion loads each candidate on; its URL."""
    serving = config.serving
    if serving.worker_urls or not config.online.eval_worker:
        raise StackError(
            "trainer.promotion.enabled needs an eval worker: set online.eval.worker_url to a worker that "
            "serves no traffic (flywheel up starts one only when it starts the serving engines and "
            "online.eval_worker is true)"
        )
    index = serving.num_workers
    child = start_engine(config_path, overrides, index, config.run.dir / "logs")
    stack.children.append(child)
    url = serving.engine_url(index)
    await wait_healthy(child, f"{url}/health", timeout_s=600)
    return url


async def _new_key(config: FlywheelConfig, kind: str, file_name: str) -> str:
    """A fresh admin or online key for this run, also written to `<run dir>/<file_name>` (mode 0600)."""
    from proxy.auth import create_admin_key, create_online_key
    from storage.engine import create_engine, create_sessionmaker
    from storage.keys import load_key_hasher

    hasher = await asyncio.to_thread(load_key_hasher, config.storage)
    engine = create_engine(config.storage)
    create = create_admin_key if kind == "admin" else create_online_key
    try:
        key = await create(create_sessionmaker(engine), hasher)
    finally:
        await engine.dispose()
    path = config.run.dir / file_name
    path.touch(mode=0o600)
    path.write_text(key + "\n")
    return key


async def wait_healthy(child: ChildProcess, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            if not child.alive():
                raise StackError(f"{child.name} exited with {child.process.returncode}:\n{child.tail()}")
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise StackError(f"{child.name} not healthy after {timeout_s:.0f} s:\n{child.tail()}")
            await asyncio.sleep(0.5)


async def run_until_stopped(stack: Stack, poll_s: float = 1.0) -> int:
    """Wait until a child dies (exit 1, with its log tail) or the task is cancelled (Ctrl-C)."""
    try:
        while (dead := stack.dead()) is None:  # noqa: ASYNC110 - polling child processes, no event to await
            await asyncio.sleep(poll_s)
        log.error("%s exited with %s:\n%s", dead.name, dead.process.returncode, dead.tail())
        return 1
    finally:
        stack.stop()


def describe(stack: Stack, run_dir: Path) -> str:
    online = ""
    if stack.online_key is not None:
        online = f"online key: {stack.online_key}   (also in {run_dir / ONLINE_KEY_FILE})\n"
    metrics = "".join(f"metrics:    {url}   ({name}, Prometheus)\n" for name, url in stack.metrics.items())
    return (
        f"proxy:      {stack.root_url}/v1   (OpenAI API; RL API under {stack.root_url}/rl/v1)\n"
        f"admin key:  {stack.admin_key}   (also in {run_dir / ADMIN_KEY_FILE})\n"
        f"{online}"
        f"{metrics}"
        f"logs:       {run_dir / 'logs'}/   pid {os.getpid()}; Ctrl-C stops everything"
    )
