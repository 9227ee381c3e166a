"""`flywheel trainer`: start Ray (locally unless told an address), the policy actor and the driver, and
train until `total_steps` or a stop signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from serving.client import SGLangClient, WorkerPool
from serving.config import ServingConfig
from storage.config import StorageConfig
from storage.engine import create_engine, create_sessionmaker
from storage.records import TrainingSample
from trainer.config import RayConfig, TrainerConfig
from trainer.distributed.handle import DistributedPolicy, start_distributed_policy
from trainer.driver import Driver, PolicyHandle
from trainer.metrics import TrainerMetrics, serve_trainer_metrics
from trainer.monitor import Monitor
from trainer.policy import Policy
from trainer.promotion import CandidateGate
from trainer.telemetry.sinks import open_sinks
from trainer.weights.distributed import DistributedSync
from trainer.weights.lora import LoraSync

logger = logging.getLogger(__name__)

GateFactory = Callable[[], AbstractAsyncContextManager[CandidateGate]]
"""Opens a candidate gate for the run and closes it after (its eval worker client, hook processes)."""

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
INITIAL_ADAPTER_DIR = "initial-adapter"
"""Under the checkpoint directory: LoRA training's version-0 adapter (`trainer/weights/lora.py`)."""


class RemotePolicy:
    """The driver's view of a `Policy` running as a Ray actor: each method awaits the actor's."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def train_step(self, samples: Sequence[TrainingSample], current_version: int) -> dict[str, float]:
        return await self.actor.train_step.remote(list(samples), current_version)

    async def save(self, checkpoint_dir: str, version: int, with_state: bool = True) -> str:
        return await self.actor.save.remote(checkpoint_dir, version, with_state)

    async def load(self, checkpoint_path: str) -> None:
        await self.actor.load.remote(checkpoint_path)

    async def model_dir(self) -> str:
        return await self.actor.model_dir.remote()

    async def call_rank0(self, method: str, *args: Any) -> Any:
        """Call the policy method `method` with `args` (the one actor is rank 0)."""
        return await getattr(self.actor, method).remote(*args)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor)


def start_policy(
    model: str, config: TrainerConfig, cache_dir: Path | None = None
) -> RemotePolicy | DistributedPolicy:
    """Create the policy actor, or with `trainer.ray.num_workers` > 1 (or GPU ranks) the data-parallel
    ranks (Ray must be initialised); models load in the actors' processes."""
    import ray

    if config.ray.num_workers > 1 or config.ray.actor_num_gpus:
        return start_distributed_policy(model, config, cache_dir)
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
    monitor = open_monitor(config, run_dir, run_settings(config, serving_config, worker_urls))
    engine = create_engine(storage_config)
    try:
        policy = start_policy(serving_config.model, config, serving_config.cache_dir)
        try:
            async with (
                WorkerPool(serving_config.client, worker_urls) as pool,
                gate() if gate is not None else contextlib.nullcontext() as opened_gate,
            ):
                await asyncio.gather(*(c.wait_until_healthy(config.worker_wait_s) for c in pool.clients))
                checkpoint_dir = config.checkpoint_dir or run_dir / CHECKPOINTS_DIR
                distributed = distributed_sync(config, policy)
                lora = await lora_sync(config, serving_config, policy, checkpoint_dir, pool.clients)
                driver = Driver(
                    config,
                    create_sessionmaker(engine),
                    policy,
                    pool.clients,
                    checkpoint_dir,
                    monitor,
                    gate=opened_gate,
                    sync=lora or distributed,
                )
                try:
                    return await driver.run(stop)
                finally:
                    if distributed is not None:
                        await distributed.close()
        finally:
            policy.kill()
    finally:
        await engine.dispose()
        monitor.close()


def run_settings(
    config: TrainerConfig, serving_config: ServingConfig, worker_urls: Sequence[str]
) -> dict[str, Any]:
    """What a run is, as experiment trackers record it once: the trainer's config, the model, the workers."""
    return {"trainer": config.model_dump(mode="json"), "model": serving_config.model,
            "workers": list(worker_urls)}


def open_monitor(config: TrainerConfig, run_dir: Path, settings: Mapping[str, Any]) -> Monitor:
    """The run's Monitor: `<run dir>/metrics.jsonl`, the Prometheus endpoint when `trainer.metrics_port` is
    set, and the TensorBoard, W&B and MLflow sinks configured (a TelemetryError when one's library is
    missing)."""
    metrics = TrainerMetrics()
    if config.metrics_port is not None:
        serve_trainer_metrics(metrics, config.metrics_host, config.metrics_port)
    try:
        sinks = open_sinks(run_dir, settings, tensorboard=config.tensorboard, wandb=config.wandb,
                           mlflow=config.mlflow)
    except BaseException:
        metrics.close()
        raise
    return Monitor(run_dir / METRICS_FILE, [metrics, *sinks])


async def lora_sync(
    config: TrainerConfig,
    serving_config: ServingConfig,
    policy: PolicyHandle,
    checkpoint_dir: Path,
    clients: Sequence[SGLangClient],
) -> LoraSync | None:
    """With `trainer.lora`, the adapter push: the fresh policy's adapter is saved as version 0 and loaded on
    the workers still at version 0; else None (the driver's default push)."""
    if config.lora is None:
        return None
    if serving_config.lora_adapter is None:
        raise ValueError("trainer.lora needs serving.lora_adapter: the name the workers serve the adapter as")
    initial_dir = checkpoint_dir / INITIAL_ADAPTER_DIR
    shutil.rmtree(initial_dir, ignore_errors=True)  # an earlier start's: B = 0 too, but maybe other shapes
    initial = await policy.save(str(initial_dir), 0, False)
    sync = LoraSync(config.weights, serving_config.lora_adapter, initial)
    await sync.prepare(clients)
    return sync


def distributed_sync(
    config: TrainerConfig, policy: RemotePolicy | DistributedPolicy
) -> DistributedSync | None:
    """With `trainer.weights.strategy: distributed`, the push over a weight-update group whose rank 0 is the
    policy actor (rank 0 of the data-parallel ranks); else None."""
    if config.weights.strategy != "distributed":
        return None
    return DistributedSync(config.weights, policy)


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
