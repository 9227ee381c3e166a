"""`DistributedSync`: push weights over a torch.distributed group, SGLang's
`/update_weights_from_distributed` path (NCCL between GPUs, gloo with the CPU engine), for workers that
share no filesystem with the trainer.

The group: the policy actor is rank 0 (`Policy.init_weight_group`, reached through the handle's
`call_rank0`) and hosts the store; worker i joins at the next free ranks (one per tensor-parallel rank,
`/server_info`'s `tp_size`), all at once while rank 0 waits for them. It is made on the first push, kept,
and made again (destroyed on both sides, then joined) when the set of workers changes or a push failed.
Before joining, each worker's leftovers of a trainer that died mid-push go: its open update session and
its group of this name.

A push, with generation paused (`pause_mode`) as the disk push does: `/begin_weight_update`, then per
bucket of at most `bucket_mb` the bucket's names, dtypes and shapes to every worker with
`/update_weights_from_distributed` while rank 0 broadcasts the bucket's tensors (read from the version's
checkpoint: `trainer/weights/broadcast.py`), the last bucket carrying the `weight_version` label and the
cache flush, then `/end_weight_update`; generation continues whatever happened.

A push that fails (a worker refuses a bucket, dies, or rank 0 fails) raises `WeightPushError` and the
driver records nothing. The group is torn down at once: rank 0 leaves it (peers blocked in a broadcast
fail at once), every worker's session is ended and its group destroyed. The CPU engine stages a push's
buckets and swaps them in only when the last one arrived complete, so it keeps serving its old weights
under its old label. SGLang loads each bucket as it arrives: a push that failed halfway may leave a SGLang
worker with some new tensors under its old label until the next push succeeds. A worker that refuses a
bucket without receiving it (no group, no open session) leaves rank 0 waiting up to `timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from yarl import URL

from serving.client import SGLangClient
from serving.weight_group import TensorMeta
from trainer.config import WeightPushConfig
from trainer.weights.broadcast import GroupEndpoint
from trainer.weights.disk import WeightPushError, failed_parties, on_all_workers, weight_version_label

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024


class Rank0(Protocol):
    """The policy handle's door to the actor holding rank 0 (`RemotePolicy`, `DistributedPolicy`)."""

    async def call_rank0(self, method: str, *args: Any) -> Any: ...


class DistributedSync:
    """`WeightSync` over a weight-update process group; `close` leaves the group at the end of a run."""

    def __init__(self, config: WeightPushConfig, policy: Rank0) -> None:
        self.config = config
        self._policy = policy
        self._members: list[SGLangClient] = []
        """The workers of the group as it stands; empty when there is none."""
        self._backend = ""

    async def push(self, clients: Sequence[SGLangClient], checkpoint_path: str, version: int) -> float:
        if not clients:
            return 0.0
        started = time.perf_counter()
        label = weight_version_label(version)
        options = self.config.distributed
        await self._join(clients)
        try:
            buckets: list[list[TensorMeta]] = await self._policy.call_rank0(
                "weight_buckets", checkpoint_path, int(options.bucket_mb * _MIB)
            )
        except Exception as exc:
            raise WeightPushError(f"planning the push of {checkpoint_path} failed: {exc}") from exc
        pause = self.config.pause_mode
        try:
            if pause is not None:
                await on_all_workers(clients, "pause", [c.pause_generation(pause) for c in clients])
            await on_all_workers(clients, "begin_weight_update", [c.begin_weight_update() for c in clients])
            for index, bucket in enumerate(buckets):
                last = index == len(buckets) - 1
                await self._send(clients, checkpoint_path, bucket, label if last else None, last)
            await on_all_workers(clients, "end_weight_update", [c.end_weight_update() for c in clients])
        except BaseException as exc:
            await self._leave()
            if isinstance(exc, Exception) and not isinstance(exc, WeightPushError):
                raise WeightPushError(f"pushing {checkpoint_path} as version {label} failed: {exc}") from exc
            raise
        finally:
            if pause is not None:  # also after a failed pause: continuing is harmless
                await on_all_workers(clients, "continue", [c.continue_generation() for c in clients])
        elapsed = time.perf_counter() - started
        logger.info(
            "pushed %s as version %s to %d worker(s) in %d bucket(s) over %s in %.2f s",
            checkpoint_path, label, len(clients), len(buckets), self._backend, elapsed,
        )
        return elapsed

    async def close(self) -> None:
        """Leave the group on both sides (a no-op without one)."""
        if self._members:
            await self._leave()

    async def _send(
        self,
        clients: Sequence[SGLangClient],
        checkpoint_path: str,
        bucket: Sequence[TensorMeta],
        label: str | None,
        last: bool,
    ) -> None:
        """One bucket: its description to every worker while rank 0 broadcasts its tensors."""
        names = [meta.name for meta in bucket]
        dtypes = [meta.dtype for meta in bucket]
        shapes = [list(meta.shape) for meta in bucket]
        flush = self.config.flush_cache and last
        group = self.config.distributed.group_name
        updates = [
            asyncio.ensure_future(
                c.update_weights_from_distributed(names, dtypes, shapes, group, label, flush_cache=flush)
            )
            for c in clients
        ]
        broadcast: Exception | None = None
        try:
            await self._policy.call_rank0("broadcast_weights", checkpoint_path, names)
        except Exception as exc:
            broadcast = exc
            # Rank 0 leaves at once, so a worker still waiting for this bucket fails now instead of at its
            # timeout (a peer that died mid-broadcast leaves the others waiting).
            await asyncio.gather(self._policy.call_rank0("destroy_weight_group"), return_exceptions=True)
        except BaseException:
            for update in updates:
                update.cancel()
            raise
        results = await asyncio.gather(*updates, return_exceptions=True)
        _raise_failures(f"a bucket of {len(names)} tensors", _parties(clients), [broadcast, *results])

    async def _join(self, clients: Sequence[SGLangClient]) -> None:
        """Make sure rank 0 and exactly `clients` are in the group."""
        if [c.base_url for c in self._members] == [c.base_url for c in clients]:
            return
        if self._members:
            await self._leave()
        options = self.config.distributed
        group = options.group_name
        try:
            infos = await asyncio.gather(*(c.server_info() for c in clients))
            endpoint: GroupEndpoint = await self._policy.call_rank0(
                "weight_group_endpoint", URL(clients[0].base_url).host or "", options.master_address,
                options.master_port, options.backend,
            )
        except Exception as exc:
            raise WeightPushError(f"preparing the weight-update group failed: {exc}") from exc
        ranks = [int(info.get("tp_size") or 1) for info in infos]
        world_size = 1 + sum(ranks)
        offsets = [1 + sum(ranks[:i]) for i in range(len(clients))]
        # Whatever a trainer that died mid-push left on the workers goes first: its update session (else
        # the next /begin_weight_update is refused) and its group of this name. Both fail when absent.
        await asyncio.gather(*(c.end_weight_update() for c in clients), return_exceptions=True)
        stale = [c.destroy_weights_update_group(group) for c in clients]
        await asyncio.gather(*stale, return_exceptions=True)
        joins = [
            c.init_weights_update_group(
                endpoint.address, endpoint.port, offset, world_size, group, endpoint.backend
            )
            for c, offset in zip(clients, offsets, strict=True)
        ]
        own = self._policy.call_rank0("init_weight_group", endpoint, world_size, group, options.timeout_s)
        results = await asyncio.gather(own, *joins, return_exceptions=True)
        self._members, self._backend = list(clients), endpoint.backend
        try:
            _raise_failures("joining the weight-update group", _parties(clients), results)
        except WeightPushError:
            await self._leave()
            raise
        logger.info(
            "weight-update group %s: rank 0 at %s:%d with %d worker(s), %d ranks, over %s",
            group, endpoint.address, endpoint.port, len(clients), world_size, endpoint.backend,
        )

    async def _leave(self) -> None:
        """Tear the group down, whatever state it is in: rank 0 leaves first (so a worker blocked in a
        broadcast fails at once), then every worker ends its update session (the CPU engine drops what it
        staged) and destroys its group. Failures (nothing to end or destroy, a worker gone) are ignored."""
        members, self._members = self._members, []
        group = self.config.distributed.group_name
        outcomes: list[Any] = [
            *await asyncio.gather(self._policy.call_rank0("destroy_weight_group"), return_exceptions=True),
            *await asyncio.gather(*(c.end_weight_update() for c in members), return_exceptions=True),
            *await asyncio.gather(
                *(c.destroy_weights_update_group(group) for c in members), return_exceptions=True
            ),
        ]
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
        logger.info("left weight-update group %s on rank 0 and %d worker(s)", group, len(members))


def _parties(clients: Sequence[SGLangClient]) -> list[str]:
    """Who answers a bucket or a join: rank 0 (the policy actor), then every worker."""
    return ["rank 0", *(c.base_url for c in clients)]


def _raise_failures(what: str, parties: Sequence[str], results: Sequence[Any]) -> None:
    """Raise WeightPushError naming each party whose result is an exception or `success: false`."""
    failures = failed_parties(parties, results)
    if failures:
        raise WeightPushError(f"{what} failed on {len(failures)} of {len(parties)}: " + "; ".join(failures))
