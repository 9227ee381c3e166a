"""A Ray cluster of two nodes on this machine, started with the `ray start` CLI the way a real multi-node
deployment is (a head, then a node joining its address), a driver that trains on it, and synthetic
training samples.

Each node gets its own ports and temp dir and runs in a process group of its own (`ray start --block`).
Teardown kills those process groups and every process they spawned, and only those: `ray stop` would stop
every Ray instance of this machine, other tests' included.

The driver runs as its own process (`python -m tests.support.ray_nodes SPEC`): a process holds one Ray
connection, and the test's may already be a local instance's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from storage.records import TrainingSample

REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")
HOST = "127.0.0.1"


def synthetic_samples(count: int, seed: int, vocab: int = 1000) -> list[TrainingSample]:
    """`count` samples of 2-5 prompt tokens and 3-24 generated ones, in groups of two, with made-up
    behaviour logprobs (off-policy: the update does not care) and rewards."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        prompt, generated = int(rng.integers(2, 6)), int(rng.integers(3, 25))
        trained = np.arange(prompt + generated) >= prompt
        samples.append(
            TrainingSample(
                trajectory_id=i,
                token_ids=rng.integers(3, vocab, prompt + generated).astype(np.int32),
                loss_mask=trained,
                logprobs=np.where(trained, rng.uniform(-4.0, -0.5, trained.size), 0.0).astype(np.float32),
                versions=np.where(trained, 0, -1).astype(np.int32),
                reward=float(rng.normal()),
                group_id=f"g{i // 2}",
            )
        )
    return samples


@dataclass
class RayNodes:
    """The head's address (`host:port`, what `ray.init(address=…)` and `trainer.ray.address` take), the
    node processes (`ray start --block`) and their temp dirs and logs."""

    address: str
    processes: list[subprocess.Popen[bytes]]
    temp_dirs: list[Path]
    logs: list[Path]

    def log_tail(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {log}\n{log.read_text(errors='replace')[-chars:]}" for log in self.logs if log.exists()
        )


def _free_ports(count: int) -> list[int]:
    """`count` distinct ports free now (all bound at once, so none is handed out twice)."""
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind((HOST, 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def _node_ports() -> list[str]:
    names = ["node-manager-port", "object-manager-port", "dashboard-agent-listen-port"]
    names += ["dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"]
    return [f"--{name}={port}" for name, port in zip(names, _free_ports(len(names)), strict=True)]


def _wait_listening(port: int, deadline: float, nodes: RayNodes) -> None:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        if any(process.poll() is not None for process in nodes.processes):
            raise RuntimeError(f"a Ray node exited\n{nodes.log_tail()}")
        time.sleep(0.2)
    raise TimeoutError(f"the Ray head never listened on {port}\n{nodes.log_tail()}")


@contextlib.contextmanager
def two_ray_nodes(cpus_per_node: int = 1, start_timeout_s: float = 120) -> Iterator[RayNodes]:
    """A head and a second node, `cpus_per_node` CPUs each, both on 127.0.0.1; stopped on exit."""
    (gcs_port,) = _free_ports(1)
    temp_dirs = [Path(tempfile.mkdtemp(prefix=f"rn{i}", dir="/tmp")) for i in range(2)]
    nodes = RayNodes(f"{HOST}:{gcs_port}", [], temp_dirs, [d / "ray-start.log" for d in temp_dirs])
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    common = [f"--node-ip-address={HOST}", f"--num-cpus={cpus_per_node}", "--num-gpus=0", "--block"]
    head = ["--head", f"--port={gcs_port}", "--include-dashboard=false", "--disable-usage-stats"]
    roles = [head, [f"--address={nodes.address}"]]
    try:
        for temp_dir, log, role in zip(temp_dirs, nodes.logs, roles, strict=True):
            command = [str(RAY), "start", *role, *common, *_node_ports(), f"--temp-dir={temp_dir}"]
            with log.open("wb") as out:
                process = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            nodes.processes.append(process)
            if role is head:
                _wait_listening(gcs_port, time.monotonic() + start_timeout_s, nodes)
        yield nodes
    finally:
        stop_nodes(nodes)


def _descendants(roots: list[int]) -> set[int]:
    """Every live process below `roots`, found through /proc's parent pids."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _naming(temp_dirs: list[Path]) -> set[int]:
    """Live processes whose command line names one of `temp_dirs` (Ray's daemons pass it along)."""
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().decode(errors="replace").split("\0")
            if any(arg.endswith(str(d)) or f"{d}/" in arg for arg in args for d in temp_dirs):
                found.add(int(cmdline.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def stop_nodes(nodes: RayNodes, grace_s: float = 3) -> None:
    """Stop the nodes' process groups (TERM, then KILL after `grace_s`), then kill whatever they spawned
    that is still alive; remove the temp dirs. Raises if a process of theirs survives."""
    ours = _descendants([p.pid for p in nodes.processes]) | _naming(nodes.temp_dirs)
    for process in nodes.processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in nodes.processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
    ours |= _descendants([p.pid for p in nodes.processes]) | _naming(nodes.temp_dirs)
    for process in nodes.processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for pid in ours:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(pid) for pid in ours | _naming(nodes.temp_dirs)):
        time.sleep(0.1)
    left = sorted(pid for pid in ours | _naming(nodes.temp_dirs) if _alive(pid))
    for temp_dir in nodes.temp_dirs:
        shutil.rmtree(temp_dir, ignore_errors=True)
    if left:
        raise RuntimeError(f"Ray processes {left} outlived their nodes")


def train_on_cluster(spec: dict[str, Any], timeout_s: float = 240) -> dict[str, Any]:
    """Run the driver below in a process of its own; returns what it reports."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.ray_nodes", json.dumps(spec)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the cluster driver failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _drive(spec: dict[str, Any]) -> dict[str, Any]:
    """Join the cluster at the config's `ray.address`, start the data-parallel ranks, and report each
    rank's node, the cluster's nodes, a train step's stats and the checkpoint rank 0 saves after it."""
    import ray

    from trainer.config import TrainerConfig
    from trainer.distributed.handle import DistributedPolicy
    from trainer.runner import init_ray, start_policy

    config = TrainerConfig.model_validate(spec["config"])
    init_ray(config.ray)
    try:
        deadline = time.monotonic() + 60
        while len([n for n in ray.nodes() if n["Alive"]]) < spec["nodes"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster has nodes {ray.nodes()}")
            await asyncio.sleep(0.2)
        policy = start_policy(spec["model"], config)
        try:
            assert isinstance(policy, DistributedPolicy)
            rank_nodes = await policy.call_all("node_id")
            stats = await policy.train_step(synthetic_samples(spec["samples"], seed=spec["seed"]), 0)
            checkpoint = await policy.save(spec["checkpoint_dir"], 1)
        finally:
            policy.kill()
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        return {"rank_nodes": rank_nodes, "nodes": nodes, "stats": stats, "checkpoint": checkpoint}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(_drive(json.loads(sys.argv[1])))), flush=True)
