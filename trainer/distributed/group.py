"""The training ranks' placement group, and the address where they meet (torch.distributed's rendezvous).

Ray reserves one bundle per rank (its CPUs, and a GPU when ranks train on GPUs) under the configured
strategy, and rank r runs in bundle r. Rank 0 names the rendezvous: its node's IP address and a port free
there, where torch.distributed's store listens and every rank connects.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Literal

from trainer.config import RayConfig

Backend = Literal["gloo", "nccl"]


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and how the ranks of one group meet."""

    host: str
    port: int
    world_size: int
    backend: Backend
    timeout_s: float
    """How long a rank waits for the others, here and at every collective after."""

    @property
    def init_method(self) -> str:
        """torch.distributed's `init_method` URL."""
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"tcp://{host}:{self.port}"


def backend_for(config: RayConfig) -> Backend:
    """NCCL when the ranks train on GPUs, gloo on CPUs."""
    return "nccl" if config.actor_num_gpus else "gloo"


def rank_bundles(config: RayConfig) -> list[dict[str, float]]:
    """One placement-group bundle per rank: the CPUs each reserves, and its GPU if it trains on one."""
    bundle = {"CPU": config.actor_num_cpus}
    if config.actor_num_gpus:
        bundle["GPU"] = float(config.actor_num_gpus)
    return [dict(bundle) for _ in range(config.num_workers)]


def reserve_ranks(config: RayConfig) -> Any:
    """Ask Ray for the ranks' placement group (Ray must be initialised); it is ready once `ready()` is."""
    from ray.util.placement_group import placement_group

    return placement_group(rank_bundles(config), strategy=config.placement_strategy)


def free_port() -> int:
    """A TCP port nobody listens on now, on this machine (the store binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def meeting_point(world_size: int, config: RayConfig) -> Rendezvous:
    """The rendezvous of a group whose rank 0 runs in this process: this node's IP and a free port."""
    import ray

    return Rendezvous(
        host=ray.util.get_node_ip_address(),
        port=free_port(),
        world_size=world_size,
        backend=backend_for(config),
        timeout_s=config.collective_timeout_s,
    )
