"""`flywheel up`: the whole system on one machine — engine(s), proxy, reward hook runner and trainer as
child processes sharing one config, the database migrated first and an admin key made for the operator."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
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

    def stop(self) -> None:
        # Trainer first (it finishes its step), the hook runner (it hands its jobs back), then the proxy
        # (it drains its recorder), engines last.
        for child in reversed(self.children):
            child.stop()

    def dead(self) -> ChildProcess | None:
        return next((child for child in self.children if not child.alive()), None)


async def start_stack(
    config: FlywheelConfig,
    config_path: str | None,
    overrides: Sequence[str],
    *,
    trainer: bool = True,
    online: bool = False,
) -> Stack:
    """Migrate, convert the model once, start engines (unless `serving.worker_urls`), the eval engine
    of gated promotion (unless `online.eval.worker_url`), the proxy, the reward hook runner and the
    trainer; return once each answers its health check. `online` also makes an online key."""
    from serving.models.loading import default_cache_dir, resolve_model_dir
    from storage import migrate

    run_dir, logs = config.run.dir, config.run.dir / "logs"
    run_dir.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(migrate.upgrade, config.storage.url)
    admin_key = await _new_key(config, "admin", ADMIN_KEY_FILE)
    serving = config.serving
    # Convert/build the model here, once, rather than in every engine and the trainer at the same time.
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
                await wait_healthy(child, f"{url}/health", timeout_s=600)
        if config.trainer.promotion.enabled and config.online.eval.worker_url is None:
            url = await _start_eval_engine(stack, config, config_path, overrides)
            trainer_overrides.append(f"online.eval.worker_url={url}")
        # Reward hooks run in a process of their own: grading never takes the proxy's CPU.
        apart = (*overrides, "rewards.runner.in_proxy=false")
        proxy = start_child("proxy", flywheel_command("proxy", config_path, apart), logs)
        stack.children.append(proxy)
        await wait_healthy(proxy, f"{stack.root_url}/health", timeout_s=120)
        runner = flywheel_command("rewards", config_path, apart, "run")
        stack.children.append(start_child("rewards", runner, logs))
        if trainer:
            argv = flywheel_command("trainer", config_path, trainer_overrides)
            stack.children.append(start_child("trainer", argv, logs))
    except BaseException:
        stack.stop()
        raise
    return stack


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
    return (
        f"proxy:      {stack.root_url}/v1   (OpenAI API; RL API under {stack.root_url}/rl/v1)\n"
        f"admin key:  {stack.admin_key}   (also in {run_dir / ADMIN_KEY_FILE})\n"
        f"{online}"
        f"logs:       {run_dir / 'logs'}/   pid {os.getpid()}; Ctrl-C stops everything"
    )
