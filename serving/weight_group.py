"""The process group of a distributed weight update, made the way SGLang makes it
(`init_custom_process_group`, sglang/srt/utils/common.py), so that a trainer and its workers meet in it
whichever they are (an SGLang server, the CPU engine).

Rank 0, the trainer, hosts a TCP store at `master_address:master_port`; each worker joins at its
`rank_offset` (one rank per tensor-parallel rank); then every tensor goes from rank 0 to all by broadcast,
one at a time, in the order both sides were told (`TensorMeta` lists). Backends: NCCL between GPUs, gloo
between CPU processes (a GPU SGLang server can receive over gloo too).

torch keeps a process-wide registry of group names, so a process is in at most one group of a given name
at a time: destroy a group before joining one of the same name again.
"""

from __future__ import annotations

import gc
import ipaddress
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a broadcast: its name in the model, torch dtype name (`float32`) and shape, as
    `/update_weights_from_distributed` lists them."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * parse_dtype(self.dtype).itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's name of a torch dtype: `torch.bfloat16` → `bfloat16`."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype a wire name means (`bfloat16`, or `torch.bfloat16`); ValueError if none."""
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


class WeightGroupError(RuntimeError):
    """A broadcast failed: a peer left or died, or the group's timeout passed."""


class WeightGroup:
    """This process's membership of one weight-update group (build it with `join`)."""

    def __init__(self, name: str, rank: int, world_size: int, backend: str, process_group: Any) -> None:
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self._group = process_group

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str,
        backend: str,
        timeout_s: float,
    ) -> WeightGroup:
        """Join group `name` as `rank` of `world_size`; blocks until every rank has joined (rank 0 hosts
        the store and waits for the others), or raises after `timeout_s`."""
        from torch.distributed.distributed_c10d import (
            Backend,
            GroupName,
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        started = time.perf_counter()
        timeout = timedelta(seconds=timeout_s)
        # What SGLang's init_custom_process_group does, step by step: the same store keys on both sides.
        store, rank, world_size = next(
            rendezvous(f"tcp://{_url_host(master_address)}:{master_port}", rank, world_size, timeout=timeout)
        )
        store.set_timeout(timeout)
        process_group, _ = _new_process_group_helper(
            world_size, rank, [], Backend(backend), PrefixStore(name, store), group_name=GroupName(name),
            timeout=timeout,
        )
        _world.pg_group_ranks[process_group] = {i: i for i in range(world_size)}
        logger.info(
            "joined weight-update group %s as rank %d of %d over %s (%s:%d) in %.2f s",
            name, rank, world_size, backend, master_address, master_port, time.perf_counter() - started,
        )
        return cls(name, rank, world_size, backend, process_group)

    @property
    def device(self) -> torch.device:
        """Where this group's tensors must be: the current GPU for NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Broadcast `tensors` from rank 0, in order: rank 0's are sent, every other rank's are filled in
        place. Raises when a peer fails or the group's timeout passes."""
        import torch.distributed as dist

        failure = None
        for tensor in tensors:
            try:
                dist.broadcast(tensor, src=0, group=self._group)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
                break
        if failure is not None:
            # Raised afresh, outside the handler: torch's exception would keep the failed call's frames, and
            # with them the process group, alive after `destroy`, and its connections open.
            raise WeightGroupError(f"broadcast in weight-update group {self.name} failed: {failure}")

    def receive(self, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
        """Receive the tensors `metas` describe (a rank other than 0), as new tensors on `device`."""
        device = self.device
        tensors = [torch.empty(meta.shape, dtype=parse_dtype(meta.dtype), device=device) for meta in metas]
        self.broadcast(tensors)
        return tensors

    def destroy(self) -> None:
        """Leave the group: its connections close, so peers blocked in a broadcast fail at once."""
        import torch.distributed as dist

        group, self._group = self._group, None
        if group is not None:
            dist.destroy_process_group(group)
            del group
            gc.collect()  # the connections close when the last reference goes
            logger.info("left weight-update group %s", self.name)


def address_toward(host: str) -> str:
    """This machine's address on the route to `host` (a worker): the one the worker can reach the
    group's store at. A loopback `host` gets the loopback address."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve worker host {host!r}: {exc}") from exc
    resolved = next((entry for entry in found if entry[0] == socket.AF_INET), found[0])  # IPv4 first
    family, address = resolved[0], str(resolved[4][0])
    if ipaddress.ip_address(address).is_loopback:
        return address
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # UDP: nothing is sent, the kernel only picks the route
        return str(probe.getsockname()[0])


def _url_host(address: str) -> str:
    """`address` as the host part of a URL (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address
