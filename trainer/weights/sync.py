"""The seam between the driver and a weight-update strategy: `WeightSync`, what every strategy in this
package implements, and `DiskSync`, the default (a safetensors checkpoint every worker reads from a shared
filesystem, `trainer/weights/disk.py`).

The driver only ever calls `push`: after a step it pushes the new version's checkpoint to every worker, at
a restart only to the workers serving something else, and on a rejected candidate the best version back.
A strategy that moves tensors itself (rather than a path) reads them from the policy it was built with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from serving.client import SGLangClient
from trainer.config import WeightPushConfig
from trainer.weights.disk import push_weights


class WeightSync(Protocol):
    """Makes serving workers serve a policy version."""

    async def push(self, clients: Sequence[SGLangClient], checkpoint_path: str, version: int) -> float:
        """Make every one of `clients` serve `version`, whose checkpoint is `checkpoint_path`; returns the
        seconds it took. Raises `WeightPushError` naming the workers that failed."""
        ...


class DiskSync:
    """`/update_weights_from_disk` on every worker: the workers read the checkpoint directory themselves,
    so it must be on a filesystem they share with the trainer."""

    def __init__(self, config: WeightPushConfig) -> None:
        self.config = config

    async def push(self, clients: Sequence[SGLangClient], checkpoint_path: str, version: int) -> float:
        return await push_weights(clients, checkpoint_path, version, self.config)
