"""The servers under test, each started as its own process and stopped (with its port freed and its
scratch database dropped) by the benchmark: the worker, the bare passthrough, Flywheel's proxy (as
`flywheel proxy` runs it, on SQLite or on a scratch Postgres database) and LiteLLM's proxy (from its own
venv, `.venv-bench/litellm`)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]
LITELLM_VERSION = "1.108.7"
LITELLM_VENV = REPO / ".venv-bench" / "litellm"
POSTGRES_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
BENCH_MODEL = "bench"
# One key secret for every `flywheel` process of a benchmark run (Postgres needs one set; storage/keys.py).
KEY_SECRET = secrets.token_hex(32)


@dataclass(frozen=True)
class Server:
    """A started server: its base URL, its process (group) and the bearer keys its clients use."""

    url: str
    pid: int
    keys: tuple[str, ...] = ("none",)
    admin_key: str | None = None
    """An admin key of the server's database (`flywheel_proxy`'s), for its RL API; None elsewhere."""

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the server's process group, children included."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == self.pid:  # process group (every server leads its own)
                total += int(fields[11]) + int(fields[12])
        return total / tick


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    secret = {"FLYWHEEL_STORAGE__KEY_SECRET": KEY_SECRET}
    return {**secret, **os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


@contextmanager
def process(
    argv: list[str], health_url: str, log: Path, env: dict[str, str] | None = None, timeout_s: float = 180.0
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `argv` (its own process group, output to `log`) until `health_url` answers 200; stop it
    (SIGTERM, then SIGKILL for the whole group) on exit."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env or _env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        asyncio.run(_wait_healthy(proc, health_url, timeout_s, log))
        yield proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group (uvicorn/gunicorn workers)
    except ProcessLookupError:
        pass
    proc.wait(10)


async def _wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args} exited ({proc.returncode}); see {log}")
            try:
                async with http.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not come up in {timeout_s:.0f} s; see {log}")


# ---- the worker and the passthrough ----------------------------------------------------------------


@contextmanager
def worker(logs: Path) -> Iterator[Server]:
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.overhead.worker", "--port", str(port)]
    with process(argv, f"http://127.0.0.1:{port}/health", logs / "worker.log") as proc:
        yield Server(f"http://127.0.0.1:{port}", proc.pid)


@contextmanager
def passthrough(
    logs: Path, upstream: str, sqlite_path: str | None = None, postgres_url: str | None = None
) -> Iterator[Server]:
    """The bare passthrough; with `sqlite_path` or `postgres_url` (asyncpg's form), the one that
    records a row per request there."""
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks.overhead.passthrough", "--port", str(port)]
    argv += ["--upstream", upstream]
    name = "passthrough"
    if sqlite_path:
        argv, name = [*argv, "--sqlite", sqlite_path], "passthrough-sqlite"
    elif postgres_url:
        argv, name = [*argv, "--postgres", postgres_url], "passthrough-postgres"
    with process(argv, f"http://127.0.0.1:{port}/health", logs / f"{name}.log", timeout_s=60) as proc:
        yield Server(f"http://127.0.0.1:{port}", proc.pid)


def count_rows(asyncpg_url: str, table: str) -> int:
    """The rows of `table` in a Postgres database (asyncpg's URL form)."""
    import asyncpg

    async def count() -> int:
        connection = await asyncpg.connect(asyncpg_url)
        try:
            return int(await connection.fetchval(f"SELECT count(*) FROM {table}"))
        finally:
            await connection.close()

    return asyncio.run(count())


# ---- Flywheel ------------------------------------------------------------------------------------------


def _flywheel(args: list[str], overrides: list[str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "flywheel.cli", *args, *overrides],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"flywheel {' '.join(args)} failed: {result.stderr[-2000:]}")
    return result.stdout


async def _create_sessions(base_url: str, admin_key: str, count: int) -> list[str]:
    headers = {"Authorization": f"Bearer {admin_key}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        keys = []
        for i in range(count):
            async with http.post(f"{base_url}/rl/v1/sessions", json={"task": f"bench-{i}"}) as response:
                response.raise_for_status()
                keys.append((await response.json())["api_key"])
        return keys


@contextmanager
def postgres_database() -> Iterator[str]:
    """A scratch database on the local Postgres server, dropped on exit."""
    import asyncpg

    name = f"flywheel_bench_{secrets.token_hex(4)}"

    async def admin(sql: str) -> None:
        connection = await asyncpg.connect(POSTGRES_SERVER)
        try:
            await connection.execute(sql)
        finally:
            await connection.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def sqlite_database() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="flywheel-bench-") as scratch:
        yield f"sqlite+aiosqlite:///{scratch}/bench.db"


UNLIMITED = "proxy.rate_limits.session.requests_per_s=1000000"
"""The load generators call far past a session key's default rate limit: what is measured is the latency
they see, not the limit (the limiter's own work is still done on every call)."""


@contextmanager
def flywheel_proxy(
    logs: Path, db_url: str, upstream: str, sessions: int, model: str = "tiny", settings: tuple[str, ...] = ()
) -> Iterator[Server]:
    """`flywheel proxy` on `db_url` (migrated first) in front of `upstream`; yields it with the keys of
    `sessions` sessions created through the RL API with an admin key from `flywheel keys create`.
    `settings` are more `key=value` overrides (`proxy.context_length=…`)."""
    port = free_port()
    overrides = [
        f"storage.url={db_url}",
        f"serving.model={model}",
        f'serving.worker_urls=["{upstream}"]',
        f"proxy.port={port}",
        "run.log_level=WARNING",
        UNLIMITED,
        *settings,
    ]
    _flywheel(["db", "upgrade"], overrides)
    admin_key = _flywheel(["keys", "create", "--admin"], overrides).strip().splitlines()[-1]
    argv = [sys.executable, "-m", "flywheel.cli", "proxy", *overrides]
    log = logs / f"flywheel-{db_url.split(':')[0]}.log"
    with process(argv, f"http://127.0.0.1:{port}/health", log) as proc:
        base_url = f"http://127.0.0.1:{port}"
        keys = tuple(asyncio.run(_create_sessions(base_url, admin_key, sessions)))
        yield Server(base_url, proc.pid, keys, admin_key)


def count_completions(db_url: str) -> int:
    from sqlalchemy import func, select

    from storage.config import StorageConfig
    from storage.engine import create_engine, create_sessionmaker
    from storage.models import Completion

    async def count() -> int:
        engine = create_engine(StorageConfig(url=db_url))
        try:
            async with create_sessionmaker(engine)() as db:
                return int((await db.execute(select(func.count()).select_from(Completion))).scalar_one())
        finally:
            await engine.dispose()

    return asyncio.run(count())


# ---- LiteLLM -------------------------------------------------------------------------------------------


def ensure_litellm() -> Path:
    """`.venv-bench/litellm` with litellm[proxy]==LITELLM_VERSION (its pins conflict with ours, so it
    never shares our venv); created on first use."""
    binary = LITELLM_VENV / "bin" / "litellm"
    if binary.exists():
        return binary
    LITELLM_VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(LITELLM_VENV)], check=True)
    subprocess.run(
        [str(LITELLM_VENV / "bin" / "pip"), "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"], check=True
    )
    return binary


@contextmanager
def litellm_proxy(logs: Path, upstream: str) -> Iterator[Server]:
    """LiteLLM's proxy (one worker, no database, no callbacks: LiteLLM at its lightest) in front of the
    worker's /v1/chat/completions; its clients use its master key (1.108 refuses to start without)."""
    binary = ensure_litellm()
    port = free_port()
    master_key = f"sk-{secrets.token_hex(16)}"
    with tempfile.TemporaryDirectory(prefix="litellm-bench-") as scratch:
        config = Path(scratch) / "config.yaml"
        config.write_text(
            "model_list:\n"
            f"  - model_name: {BENCH_MODEL}\n"
            "    litellm_params:\n"
            f"      model: openai/{BENCH_MODEL}\n"
            f"      api_base: {upstream}/v1\n"
            "      api_key: none\n"
            "litellm_settings:\n"
            "  drop_params: true\n"
            "  turn_off_message_logging: true\n"
            "general_settings:\n"
            f"  master_key: {master_key}\n"
        )
        env = {
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("PYTHONPATH", None)
        argv = [
            str(binary),
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ]
        health = f"http://127.0.0.1:{port}/health/liveliness"
        with process(argv, health, logs / "litellm.log", env=env, timeout_s=300) as proc:
            yield Server(f"http://127.0.0.1:{port}", proc.pid, (master_key,))
