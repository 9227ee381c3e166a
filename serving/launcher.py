"""Start and stop real SGLang servers (`python -m sglang.launch_server`) for `serving.backend = sglang`.

Flag names are those of sglang 0.5.23 (`sglang/srt/arg_groups/fields/*.py`). The server runs in its
own process group, because SGLang forks scheduler and detokenizer processes that must die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Self

from serving.client import SGLangClient
from serving.config import ClientConfig, SGLangLaunchConfig
from serving.errors import WorkerLaunchError, WorkerTimeout

logger = logging.getLogger(__name__)

OUTPUT_TAIL_LINES = 50
_SECRET_FLAGS = frozenset({"--admin-api-key", "--api-key"})


def build_sglang_command(
    model_path: str,
    port: int,
    host: str,
    config: SGLangLaunchConfig,
    served_model_name: str | None = None,
) -> list[str]:
    """The argv of one SGLang server. Optional flags are left out when unset, so SGLang's own
    defaults apply; `config.extra_args` come last, verbatim, so they can override anything."""
    command = [
        config.python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", host,
        "--port", str(port),
        "--tp-size", str(config.tp_size),
    ]
    optional = (
        ("--mem-fraction-static", config.mem_fraction_static),
        ("--context-length", config.context_length),
        ("--dtype", config.dtype),
        ("--served-model-name", served_model_name),
        ("--admin-api-key", config.admin_api_key),
    )
    for flag, value in optional:
        if value is not None:
            command += [flag, str(value)]
    return command + list(config.extra_args)


def redact_command(command: list[str]) -> list[str]:
    """The command with secret flag values replaced, for logs and error messages."""
    return [
        "***" if index > 0 and command[index - 1] in _SECRET_FLAGS else arg
        for index, arg in enumerate(command)
    ]


def _connect_host(host: str) -> str:
    """Where to reach a server bound to `host`: a wildcard bind is reached on loopback."""
    if host in ("0.0.0.0", "", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


@dataclass
class LaunchedWorker:
    """A running SGLang server process and its URL. `stop()` ends it and everything it forked."""

    url: str
    command: list[str]
    process: asyncio.subprocess.Process
    _tail: deque[str] = field(default_factory=lambda: deque(maxlen=OUTPUT_TAIL_LINES))
    _drain: asyncio.Task[None] | None = None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def output_tail(self) -> list[str]:
        """The last lines the process wrote (stdout and stderr together)."""
        return list(self._tail)

    async def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM the process group, SIGKILL it after `timeout_s`; returns the exit code."""
        if self.process.returncode is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), timeout_s)
            except TimeoutError:
                logger.warning("SGLang server %s ignored SIGTERM for %.0fs; killing it", self.url, timeout_s)
        # Children may outlive the leader (or the leader ignored SIGTERM): leave nothing behind.
        _signal_group(self.process.pid, signal.SIGKILL)
        returncode = await self.process.wait()
        await self._finish_drain()
        return returncode

    async def _finish_drain(self) -> None:
        if self._drain is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._drain), 5.0)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def _drain_output(
    stream: asyncio.StreamReader, tail: deque[str], name: str, log_file: BinaryIO | None
) -> None:
    """Read the process's output to the end (a full pipe would stall the server), keeping the tail.
    Reads chunks, not lines: one over-long line must not kill the reader."""
    pending = b""
    while chunk := await stream.read(1 << 16):
        if log_file is not None:
            log_file.write(chunk)
            log_file.flush()
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            _keep_line(line, tail, name)
    if pending:
        _keep_line(pending, tail, name)
    if log_file is not None:
        log_file.close()


def _keep_line(raw: bytes, tail: deque[str], name: str) -> None:
    text = raw.decode("utf-8", "replace").rstrip()
    if text:
        tail.append(text)
        logger.debug("[%s] %s", name, text)


async def launch_sglang_worker(
    model_path: str,
    port: int,
    config: SGLangLaunchConfig,
    *,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    client_config: ClientConfig | None = None,
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
) -> LaunchedWorker:
    """Start an SGLang server and return once its `/health` answers 200.

    Raises WorkerLaunchError, with the process's last output lines, when it exits first or is not
    healthy within `config.startup_timeout_s` (the process is then stopped). `env` replaces the
    environment when given; `log_path` receives the server's whole output.
    """
    command = build_sglang_command(model_path, port, host, config, served_model_name)
    url = f"http://{_connect_host(host)}:{port}"
    logger.info("starting SGLang server %s: %s", url, " ".join(redact_command(command)))
    log_file = log_path.open("ab") if log_path is not None else None
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(env) if env is not None else None,
        start_new_session=True,
    )
    worker = LaunchedWorker(url=url, command=command, process=process)
    if process.stdout is not None:  # always, with stdout=PIPE; narrows the type
        worker._drain = asyncio.create_task(
            _drain_output(process.stdout, worker._tail, f"sglang:{port}", log_file)
        )
    try:
        await _wait_until_serving(worker, config.startup_timeout_s, client_config or ClientConfig())
    except BaseException:
        await worker.stop()
        raise
    logger.info("SGLang server %s is healthy (pid %d)", url, process.pid)
    return worker


async def _wait_until_serving(worker: LaunchedWorker, timeout_s: float, client_config: ClientConfig) -> None:
    """Race `/health` against the process exiting."""
    async with SGLangClient(worker.url, client_config) as client:
        healthy = asyncio.create_task(client.wait_until_healthy(timeout_s))
        exited = asyncio.create_task(worker.process.wait())
        try:
            done, _ = await asyncio.wait({healthy, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (healthy, exited):
                task.cancel()
            await asyncio.gather(healthy, exited, return_exceptions=True)
        if healthy in done and not healthy.cancelled():
            try:
                healthy.result()
                return
            except WorkerTimeout as exc:
                raise WorkerLaunchError(
                    f"SGLang server {worker.url} not healthy after {timeout_s:.0f}s",
                    url=worker.url, output_tail=worker.output_tail(),
                ) from exc
        await worker._finish_drain()
        raise WorkerLaunchError(
            f"SGLang server {worker.url} exited with code {worker.process.returncode} before it was healthy",
            url=worker.url, output_tail=worker.output_tail(),
        )
