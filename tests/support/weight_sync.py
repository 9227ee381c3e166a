"""Helpers for the distributed weight-push tests and benchmark: CPU engines as processes of their own
(`flywheel engine`: a process joins a weight-update group of a name only once, and a test kills one
mid-push), the policy as rank 0 in this process, clients that record or tamper with what they send, and
new weights to push."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from serving.client import SGLangClient
from serving.config import ClientConfig
from serving.models.loading import load_model
from serving.threaded_server import free_port
from trainer.checkpoint import save_checkpoint

Tamper = Callable[[str, dict[str, Any]], dict[str, Any]]
"""Sees each admin call's path and body before it is sent; returns the body to send."""


class EngineProcess:
    """One `flywheel engine` (the CPU engine) on a loopback port, its output in `log`."""

    def __init__(self, model_dir: Path, log: Path, *, dtype: str = "float32", port: int = 0) -> None:
        self.model_dir = model_dir
        self.log = log
        self.dtype = dtype
        self.port = port or free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process (on the same port as before, after a kill); `wait_healthy` waits for it."""
        command = [
            sys.executable, "-m", "flywheel.cli", "engine", f"serving.model={self.model_dir}",
            f"serving.port={self.port}", "serving.host=127.0.0.1", "serving.cpu.num_threads=1",
            f"serving.cpu.dtype={self.dtype}", f"run.dir={self.log.parent}",
        ]
        with self.log.open("ab") as out:
            self._process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                             env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None and self._process.poll() is None, self.tail()
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"engine at {self.url} not healthy after {timeout_s} s\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL: the process dies with its connections, mid-whatever."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(30)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def engine_processes(model_dir: Path, count: int, log_dir: Path, dtype: str = "float32") -> Iterator[
        list[EngineProcess]]:
    """`count` engines serving `model_dir`, started together and healthy; stopped after."""
    engines = [EngineProcess(model_dir, log_dir / f"engine-{i}.log", dtype=dtype) for i in range(count)]
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_healthy()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


class LocalRank0:
    """The policy handle's `call_rank0` on a policy in this process: each call in a worker thread, as the
    actor runs it in its own."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy

    async def call_rank0(self, method: str, *args: Any) -> Any:
        return await asyncio.to_thread(getattr(self.policy, method), *args)


class RecordingClient(SGLangClient):
    """An SGLang client that appends each admin call's (path, body) to `sent`, after `tamper` (if any)
    had its say."""

    def __init__(self, base_url: str, sent: list[tuple[str, dict[str, Any]]], tamper: Tamper | None = None,
                 config: ClientConfig | None = None) -> None:
        super().__init__(base_url, config or ClientConfig(max_retries=0))
        self.sent = sent
        self.tamper = tamper

    async def _admin_json(self, path: str, body: dict[str, Any], *, idempotent: bool) -> dict[str, Any]:
        if self.tamper is not None:
            body = self.tamper(path, body)
        self.sent.append((path, body))
        return await super()._admin_json(path, body, idempotent=idempotent)


def on_bucket(number: int, act: Callable[[dict[str, Any]], dict[str, Any]]) -> Tamper:
    """A `Tamper` that lets `act` change (or act before) the `number`th `/update_weights_from_distributed`
    body it sees, counting from 1, and passes everything else."""
    seen = 0

    def tamper(path: str, body: dict[str, Any]) -> dict[str, Any]:
        nonlocal seen
        if path != "/update_weights_from_distributed":
            return body
        seen += 1
        return act(body) if seen == number else body

    return tamper


def perturbed_checkpoint(model_dir: Path, checkpoint_dir: Path, version: int, seed: int) -> Path:
    """Save the model of `model_dir` with every weight moved by seeded noise as checkpoint `version`."""
    model = load_model(str(model_dir)).model
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return save_checkpoint(model, model_dir, checkpoint_dir, version)
