"""One training rank: a `Policy` that joins a data-parallel group, its model in DistributedDataParallel.

It runs as a Ray actor in bundle `rank` of the ranks' placement group. Being a `Policy`, it has every
method the single policy actor has (`train_step` trains its share of each minibatch, `save`, `load`, and
whatever else `Policy` gains), so the handle can call any of them on rank 0 or on every rank.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import TrainerConfig
from trainer.distributed.group import Rendezvous, meeting_point
from trainer.policy import Policy


class RankPolicy(Policy):
    """Rank `rank` of `world_size`; it trains alone until `join` makes it part of the group."""

    def __init__(
        self, model: str, config: TrainerConfig, cache_dir: Path | None, rank: int, world_size: int
    ) -> None:
        super().__init__(model, config, cache_dir)
        self._joining = (rank, world_size)

    def rendezvous(self) -> Rendezvous:
        """Where the group meets (asked of rank 0): this node's address and a port free on it."""
        return meeting_point(self._joining[1], self._config.ray)

    def join(self, rendezvous: Rendezvous) -> None:
        """Join torch.distributed's default group (returns once every rank has) and wrap the model in
        DDP: on this rank's GPU with NCCL (Ray shows the actor only the GPU it reserved), else on CPU."""
        rank, world_size = self._joining
        dist.init_process_group(
            rendezvous.backend,
            init_method=rendezvous.init_method,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=rendezvous.timeout_s),
        )
        device = torch.device("cpu")
        if rendezvous.backend == "nccl":
            torch.cuda.set_device(0)
            device = torch.device("cuda", 0)
        self.join_data_parallel(rank, world_size, device)

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())
