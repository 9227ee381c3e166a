"""Helpers for the trainer's resume and crash tests: deterministic samples, an uninterrupted reference
run of the policy, `flywheel trainer` as a killable subprocess (with its own Ray), and a proxy in front of
a worker that holds chosen control calls back, so that a test knows where the trainer is when it kills it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import ClientSession, ClientTimeout, web
from sqlalchemy import make_url

from storage.engine import SessionFactory
from storage.queries import create_group, insert_trajectories
from storage.records import GroupRecord, SessionRecord, TrainingSample, TrajectoryRecord
from tests.support.databases import key_hash
from trainer.config import TrainerConfig
from trainer.policy import Policy

PROMPT_LEN = 4


def fixed_trajectory(seed: int, length: int, reward: float) -> TrajectoryRecord:
    """A trajectory of `length` tokens made from `seed` alone: a prompt of `PROMPT_LEN` masked tokens,
    then trained tokens of version 0 with made-up behaviour logprobs."""
    rng = np.random.default_rng(seed)
    trained = length - PROMPT_LEN
    return TrajectoryRecord(
        token_ids=rng.integers(10, 1000, length).tolist(),
        loss_mask=[False] * PROMPT_LEN + [True] * trained,
        logprobs=[0.0] * PROMPT_LEN + rng.uniform(-4.0, -0.5, trained).round(3).tolist(),
        versions=[-1] * PROMPT_LEN + [0] * trained,
        reward=reward,
    )


def fixed_samples(count: int, length: int, group_size: int = 2, lone: int = 0) -> list[TrainingSample]:
    """`count` samples as `fixed_trajectory` makes them, in groups of `group_size` in order, then `lone`
    samples without a group (each with a running-baseline key)."""
    samples = []
    for i in range(count + lone):
        grouped = i < count
        samples.append(
            as_sample(
                i + 1,
                f"g{i // group_size}" if grouped else None,
                fixed_trajectory(i, length, reward=float(i % 3)),
                baseline_key=None if grouped else f"key:{i % 2}",
            )
        )
    return samples


def as_sample(
    trajectory_id: int, group_id: str | None, record: TrajectoryRecord, baseline_key: str | None = None
) -> TrainingSample:
    """The sample the trainer claims for `record`."""
    return TrainingSample(
        trajectory_id=trajectory_id,
        token_ids=np.array(record.token_ids, dtype=np.int32),
        loss_mask=np.array(record.loss_mask, dtype=bool),
        logprobs=np.array(record.logprobs, dtype=np.float32),
        versions=np.array(record.versions, dtype=np.int32),
        reward=record.reward,
        group_id=group_id,
        temperature=record.temperature,
        baseline_key=baseline_key,
    )


async def insert_fixed_groups(
    session_factory: SessionFactory, groups: int, size: int, length: int
) -> list[list[TrainingSample]]:
    """Insert `groups` finalized groups of `size` fixed trajectories, in order; the samples a trainer
    claims for them, group by group."""
    inserted = []
    for g in range(groups):
        gid = f"crash-g{g}"
        sessions = [
            SessionRecord(id=f"{gid}-{i}", key_hash=key_hash(f"{gid}-{i}"), group_id=gid) for i in range(size)
        ]
        await create_group(session_factory, GroupRecord(id=gid, size=size), sessions)
        group = []
        for i, session in enumerate(sessions):
            seed = g * size + i
            record = fixed_trajectory(seed, length, reward=float(seed % 3))
            (trajectory_id,) = await insert_trajectories(session_factory, session.id, [record])
            group.append(as_sample(trajectory_id, gid, record))
        inserted.append(group)
    return inserted


def weights(policy: Policy) -> dict[str, torch.Tensor]:
    """A copy of the policy's parameters."""
    return {name: p.detach().clone() for name, p in policy._model.named_parameters()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two sets of equally named tensors."""
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def reference_run(
    model_dir: Path, config: TrainerConfig, batches: Sequence[Sequence[TrainingSample]]
) -> dict[str, torch.Tensor]:
    """The weights an uninterrupted policy has after one step per batch, step `s` at version `s - 1`.
    Policy sets torch's thread count from `config.num_threads`; the caller's is put back after."""
    threads = torch.get_num_threads()
    try:
        policy = Policy(str(model_dir), config)
        for version, batch in enumerate(batches):
            policy.train_step(batch, current_version=version)
        return weights(policy)
    finally:
        torch.set_num_threads(threads)


# --- `flywheel trainer` as a subprocess -------------------------------------------------------------


def start_trainer(overrides: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """`python -m flywheel.cli trainer OVERRIDES` in a session of its own (so that `kill_trainer` reaches
    the Ray processes it starts), its output appended to `log_path`."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    with log_path.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "flywheel.cli", "trainer", *overrides],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def trainer_processes(session: int, ray_dir: Path) -> list[int]:
    """Pids of live processes of a trainer started by `start_trainer`: those of its session (`session` is
    the trainer's pid), and any whose command line names its Ray temp dir (in case one left the session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        state, _ppid, _pgrp, sid = stat.rsplit(")", 1)[1].split()[:4]
        if state != "Z" and (int(sid) == session or str(ray_dir).encode() in cmdline):
            found.append(int(entry.name))
    return found


def kill_trainer(process: subprocess.Popen[bytes], ray_dir: Path) -> None:
    """`kill -9` the trainer's whole process group, then every process left of its session or its Ray
    instance; waits until none is left."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(30)
    deadline = time.monotonic() + 30
    while leftovers := trainer_processes(process.pid, ray_dir):
        assert time.monotonic() < deadline, f"trainer processes {leftovers} survive"
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.02) -> Any:
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(poll_s)


# --- a worker proxy that holds control calls ----------------------------------------------------------


@dataclass
class Seen:
    """One request the proxy received: its path, JSON body, and whether it was answered."""

    path: str
    body: dict[str, Any]
    answered: bool = False


@dataclass
class _Hold:
    path: str
    version: str | None
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    forward: bool = True


class HoldingProxy:
    """Forwards every request to `target` (a worker) and records it; `hold(path, version)` makes the next
    such request (with that `weight_version`, when given) wait until `release()`, then be forwarded, or
    answered 503 without reaching the worker (`forward=False`: the caller died meanwhile)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: list[Seen] = []
        self._holds: list[_Hold] = []
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._session = ClientSession(timeout=ClientTimeout(total=300))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        for hold in self._holds:
            hold.forward = False
            hold.release.set()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def hold(self, path: str, version: str | None = None) -> _Hold:
        held = _Hold(path, version)
        self._holds.append(held)
        return held

    def paths_since(self, index: int) -> list[str]:
        return [seen.path for seen in self.seen[index:]]

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = await request.json() if raw and request.content_type == "application/json" else {}
        seen = Seen(request.path, body if isinstance(body, dict) else {})
        self.seen.append(seen)
        held = next((h for h in self._holds if self._matches(h, seen)), None)
        if held is not None:
            self._holds.remove(held)
            held.arrived.set()
            await asyncio.to_thread(held.release.wait)
            if not held.forward:
                return web.json_response({"success": False, "message": "dropped by the test"}, status=503)
        assert self._session is not None
        async with self._session.request(
            request.method, f"{self.target}{request.path_qs}", data=raw, headers=_forwarded(request)
        ) as answer:
            payload = await answer.read()
            seen.answered = True
            return web.Response(body=payload, status=answer.status, content_type=answer.content_type)

    @staticmethod
    def _matches(hold: _Hold, seen: Seen) -> bool:
        version = seen.body.get("weight_version")
        return hold.path == seen.path and (hold.version is None or version == hold.version)


def _forwarded(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in {"content-type", "authorization"}}


# --- holding the table record_step writes --------------------------------------------------------------


class RecordLock:
    """Blocks `record_step` on Postgres while held: `LOCK TABLE policy_versions IN ACCESS EXCLUSIVE MODE`
    (the table it writes first) in an open transaction. Called from the test's thread; the connection
    lives on `loop`."""

    def __init__(self, db_url: str, loop: asyncio.AbstractEventLoop) -> None:
        self._dsn = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
        self._loop = loop
        self._connection: Any = None

    def take(self) -> None:
        self._connection = self._call(self._lock(self._dsn))

    def record_is_waiting(self) -> bool:
        """Whether another transaction waits for the lock (the step's record: nothing else writes or
        reads policy_versions while a step pushes)."""
        query = "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'policy_versions'::regclass"
        return bool(self._call(self._connection.fetchval(query)))

    def release(self) -> None:
        if self._connection is not None:
            self._call(self._unlock(self._connection))
            self._connection = None

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    @staticmethod
    async def _lock(dsn: str) -> Any:
        import asyncpg

        connection = await asyncpg.connect(dsn)
        await connection.execute("BEGIN")
        await connection.execute("LOCK TABLE policy_versions IN ACCESS EXCLUSIVE MODE")
        return connection

    @staticmethod
    async def _unlock(connection: Any) -> None:
        await connection.execute("ROLLBACK")
        await connection.close()
