"""`flywheel trainer`: start Ray (locally unless told an address), the policy actor and the driver, and
train until `total_steps` or a stop signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from serving.client import WorkerPool
from serving.config import ServingConfig
from storage.config import StorageConfig
from storage.engine import create_engine, create_sessionmaker
from storage.records import TrainingSample
from trainer.config import RayConfig, TrainerConfig
from trainer.driver import Driver
from trainer.monitor import Monitor
from trainer.policy import Policy
from trainer.promotion import CandidateGate

logger = logging.getLogger(__name__)

GateFactory = Callable[[], AbstractAsyncContextManager[CandidateGate]]
"""Opens a candidate gate for the run and closes it after (its eval worker client, hook processes)."""

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"


class RemotePolicy:
    """The driver's view of a `Policy` running as a Ray actor: each method awaits the actor's."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def train_step(self, samples: Sequence[TrainingSample], current_version: int) -> dict[str, float]:
        return await self.actor.train_step.remote(list(samples), current_version)

    async def save(self, checkpoint_dir: str, version: int, with_state: bool = False) -> str:
        return await self.actor.save.remote(checkpoint_dir, version, with_state)

    async def load(self, checkpoint_path: str) -> None:
        await self.actor.load.remote(checkpoint_path)

    async def model_dir(self) -> str:
        return await self.actor.model_dir.remote()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


def start_policy(model: str, config: TrainerConfig, cache_dir: Path | None = None) -> RemotePolicy:
    """Create the policy actor (Ray must be initialised); its model loads in the actor's process."""
    import ray

    actor_class = ray.remote(num_cpus=config.ray.actor_num_cpus, max_restarts=0)(Policy)
    return RemotePolicy(actor_class.remote(model, config, cache_dir))


def init_ray(config: RayConfig) -> bool:
    """Connect to `config.address`, or start a local Ray instance; False if Ray was already running."""
    import ray

    if ray.is_initialized():
        return False
    if config.address is not None:
        ray.init(address=config.address, configure_logging=False)
    else:
        ray.init(
            num_cpus=config.num_cpus,
            include_dashboard=False,
            _temp_dir=str(config.temp_dir) if config.temp_dir else None,
            configure_logging=False,
        )
    return True


async def train(
    config: TrainerConfig,
    storage_config: StorageConfig,
    serving_config: ServingConfig,
    worker_urls: Sequence[str],
    run_dir: Path,
    stop: asyncio.Event | None = None,
    gate: GateFactory | None = None,
) -> int:
    """Run the driver with a fresh policy actor until done or `stop`; returns the last policy version.
    `gate` opens the candidate gate of eval-gated promotion (trainer/promotion.py) for the run."""
    if not worker_urls:
        raise ValueError("the trainer needs at least one worker URL to push weights to")
    engine = create_engine(storage_config)
    policy = start_policy(serving_config.model, config, serving_config.cache_dir)
    try:
        async with (
            WorkerPool(serving_config.client, worker_urls) as pool,
            gate() if gate is not None else contextlib.nullcontext() as opened_gate,
        ):
            await asyncio.gather(*(c.wait_until_healthy(config.worker_wait_s) for c in pool.clients))
            driver = Driver(
                config,
                create_sessionmaker(engine),
                policy,
                pool.clients,
                config.checkpoint_dir or run_dir / CHECKPOINTS_DIR,
                Monitor(run_dir / METRICS_FILE),
                gate=opened_gate,
            )
            return await driver.run(stop)
    finally:
        policy.kill()
        await engine.dispose()


def run_trainer(
    trainer_config: TrainerConfig,
    storage_config: StorageConfig,
    serving_config: ServingConfig,
    worker_urls: Sequence[str],
    *,
    run_dir: Path = Path("flywheel-run"),
    gate: GateFactory | None = None,
) -> None:
    """Blocking entry point: Ray up, train until `total_steps` or SIGINT/SIGTERM (the step in flight
    finishes first), Ray down (if this call started it)."""
    started_ray = init_ray(trainer_config.ray)
    try:
        asyncio.run(
            _train_until_signalled(trainer_config, storage_config, serving_config, worker_urls, run_dir, gate)
        )
    finally:
        if started_ray:
            import ray

            ray.shutdown()


async def _train_until_signalled(
    config: TrainerConfig,
    storage_config: StorageConfig,
    serving_config: ServingConfig,
    worker_urls: Sequence[str],
    run_dir: Path,
    gate: GateFactory | None,
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    for signum in signals:  # handlers can only be installed from the main thread
        loop.add_signal_handler(signum, _on_signal, stop, signum)
    try:
        version = await train(config, storage_config, serving_config, worker_urls, run_dir, stop, gate)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
    logger.info("trainer stopped at policy version %d", version)


def _on_signal(stop: asyncio.Event, signum: int) -> None:
    logger.info("%s: stopping after the step in flight", signal.Signals(signum).name)
    stop.set()
