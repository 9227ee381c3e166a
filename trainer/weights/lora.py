"""Push a LoRA adapter checkpoint to every serving worker (`trainer.lora`) with SGLang's dynamic adapter
loading: SGLang started with `--enable-lora`, and the CPU engine.

Every worker serves the policy as one adapter, named `serving.lora_adapter`, over its unchanged base
model, and the proxy names that adapter in every request. A push pauses generation (abort: in-flight
requests end with their partial output and the proxy resumes them on the new version), then on each
worker unloads the adapter (when it is loaded), loads the new version's under the same name and
relabels the worker's `weight_version`; generation continues after, whatever happened.

Version 0 is the adapter as peft initialised it (B = 0: exactly the base model), saved once when the
trainer starts (`initial_adapter`). Workers that report version 0 already ("default") are left alone by
the driver, so `prepare` loads it on them before training starts: requests always find the adapter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from serving.client import SGLangClient
from serving.errors import WorkerBadRequest
from trainer.config import WeightPushConfig
from trainer.lora import is_adapter_checkpoint
from trainer.weights.disk import (
    INITIAL_WEIGHT_VERSION,
    WeightPushError,
    on_all_workers,
    served_versions,
    weight_version_label,
)

logger = logging.getLogger(__name__)

NOT_LOADED = "does not exist"
"""What SGLang (and the CPU engine) says when asked to unload a name that is not loaded."""


class LoraSync:
    """`WeightSync` of LoRA training: each version's adapter loaded under `adapter_name` on every worker."""

    def __init__(self, config: WeightPushConfig, adapter_name: str, initial_adapter: str) -> None:
        self.config = config
        self.adapter_name = adapter_name
        self.initial_adapter = initial_adapter

    async def push(self, clients: Sequence[SGLangClient], checkpoint_path: str, version: int) -> float:
        """Make every one of `clients` serve `version`'s adapter; `checkpoint_path` is its adapter
        checkpoint (or, for version 0, the base model's directory: the initial adapter is loaded)."""
        started = time.perf_counter()
        label = weight_version_label(version)
        adapter = self._adapter_path(checkpoint_path, version)
        mode = self.config.pause_mode or "abort"  # the config allows only abort with LoRA
        try:
            await on_all_workers(clients, "pause", [c.pause_generation(mode) for c in clients])
            swaps = [self._swap(c, adapter, label) for c in clients]
            await on_all_workers(clients, f"loading adapter {adapter} as version {label}", swaps)
        finally:  # also after a failed pause: continuing is harmless
            await on_all_workers(clients, "continue", [c.continue_generation() for c in clients])
        elapsed = time.perf_counter() - started
        logger.info(
            "pushed adapter %s as %s version %s to %d worker(s) in %.2f s",
            adapter, self.adapter_name, label, len(clients), elapsed,
        )
        return elapsed

    async def prepare(self, clients: Sequence[SGLangClient]) -> None:
        """Load the initial adapter on the workers that serve version 0 (a fresh worker has no adapter)."""
        served = await served_versions(clients)
        fresh = [c for c in clients if served[c.base_url] == INITIAL_WEIGHT_VERSION]
        if fresh:
            await self.push(fresh, self.initial_adapter, 0)

    def _adapter_path(self, checkpoint_path: str, version: int) -> str:
        if is_adapter_checkpoint(checkpoint_path):
            return checkpoint_path
        if version == 0:
            return self.initial_adapter
        raise WeightPushError(f"{checkpoint_path} is not a LoRA adapter checkpoint (version {version})")

    async def _swap(self, client: SGLangClient, adapter: str, label: str) -> dict[str, Any]:
        try:
            await client.unload_lora_adapter(self.adapter_name)
        except WorkerBadRequest as exc:
            if NOT_LOADED not in str(exc):
                raise
        await client.load_lora_adapter(self.adapter_name, adapter)
        return await client.update_weight_version(label)
