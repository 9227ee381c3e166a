"""`DistributedPolicy`: the driver's `PolicyHandle` over N training ranks (trainer/distributed/worker.py).

`train_step` hands every rank the whole batch (put in Ray's object store once): each computes the same
advantages and minibatch split, trains its share of each minibatch, and returns the same statistics, so
the driver gets what one policy actor would give. `save` and `model_dir` ask rank 0 (every rank holds the
same weights and optimiser state); `load` loads on every rank, from a path each rank's node must see.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from storage.records import TrainingSample
from trainer.config import TrainerConfig
from trainer.distributed.group import reserve_ranks
from trainer.distributed.worker import RankPolicy


class DistributedPolicy:
    """The ranks of one data-parallel group; every method first waits until they have all joined."""

    def __init__(self, ranks: Sequence[Any], group: Any, joined: Sequence[Any], placement_timeout_s: float):
        self.ranks = list(ranks)
        self._group = group
        self._joined = list(joined)
        self._placement_timeout_s = placement_timeout_s
        self._ready = False

    async def wait_ready(self) -> None:
        """Return once the placement group is placed and every rank has joined the group; raise if the
        cluster has no room for it within the placement timeout, or a rank failed to join."""
        if self._ready:
            return
        try:
            await asyncio.wait_for(self._group.ready(), self._placement_timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"no room in the Ray cluster for {len(self.ranks)} training ranks after "
                f"{self._placement_timeout_s:g} s (bundles {self._group.bundle_specs})"
            ) from None
        await asyncio.gather(*self._joined)
        self._ready = True

    async def train_step(self, samples: Sequence[TrainingSample], current_version: int) -> dict[str, float]:
        import ray

        await self.wait_ready()
        batch = ray.put(list(samples))
        steps = [rank.train_step.remote(batch, current_version) for rank in self.ranks]
        return (await asyncio.gather(*steps))[0]  # the same on every rank

    async def save(self, checkpoint_dir: str, version: int, with_state: bool = True) -> str:
        return await self.call_rank0("save", checkpoint_dir, version, with_state)

    async def load(self, checkpoint_path: str) -> None:
        await self.call_all("load", checkpoint_path)

    async def model_dir(self) -> str:
        return await self.call_rank0("model_dir")

    async def call_rank0(self, method: str, *args: Any) -> Any:
        """Call the policy method `method` with `args` on rank 0 alone."""
        await self.wait_ready()
        return await getattr(self.ranks[0], method).remote(*args)

    async def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call the policy method `method` with `args` on every rank; their results in rank order."""
        await self.wait_ready()
        return list(await asyncio.gather(*(getattr(rank, method).remote(*args) for rank in self.ranks)))

    def kill(self) -> None:
        """End the ranks and free their placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for rank in self.ranks:
            ray.kill(rank)
        remove_placement_group(self._group)


def start_distributed_policy(
    model: str, config: TrainerConfig, cache_dir: Path | None = None
) -> DistributedPolicy:
    """Reserve the ranks' placement group and start rank r in bundle r (Ray must be initialised); the
    ranks load the model, meet at rank 0's rendezvous and wrap their models in DDP in the background."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world_size = config.ray.num_workers
    group = reserve_ranks(config.ray)
    rank_class = ray.remote(
        num_cpus=config.ray.actor_num_cpus, num_gpus=config.ray.actor_num_gpus, max_restarts=0
    )(RankPolicy)
    ranks: list[Any] = [
        rank_class.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
        ).remote(model, config, cache_dir, rank, world_size)
        for rank in range(world_size)
    ]
    meeting = ranks[0].rendezvous.remote()  # resolved by Ray before any rank runs `join`
    joined = [rank.join.remote(meeting) for rank in ranks]
    return DistributedPolicy(ranks, group, joined, config.ray.placement_timeout_s)
