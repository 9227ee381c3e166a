"""A Postgres server of the test's own (its own data directory and port), which a test may stop and start
without touching the shared server the other tests use. Built from Debian's `postgresql` binaries; as
root, the server runs as the `postgres` user (it refuses to run as root)."""

from __future__ import annotations

import getpass
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from sqlalchemy import make_url


def postgres_bin_dir() -> Path | None:
    """The newest installed Postgres's binaries (initdb, pg_ctl), if any."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PostgresCluster:
    """`start()` once to create it; `stop()` and `start()` again as the test needs; `destroy()` at the end."""

    def __init__(self, bin_dir: Path) -> None:
        self.bin_dir = bin_dir
        self.port = _free_port()
        self.root = Path(tempfile.mkdtemp(prefix="flywheel-pg-"))
        self.data = self.root / "data"
        self._as_postgres = os.geteuid() == 0
        os.chmod(self.root, 0o777)
        self._initialized = False

    def url(self, database: str = "postgres") -> str:
        user = "postgres" if self._as_postgres else getpass.getuser()
        return str(make_url(f"postgresql+asyncpg://{user}@127.0.0.1:{self.port}/{database}"))

    def _run(self, *argv: str) -> None:
        command = [str(self.bin_dir / argv[0]), *argv[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        if not self._initialized:
            self._run("initdb", "-D", str(self.data), "-A", "trust", "-U",
                      "postgres" if self._as_postgres else getpass.getuser(), "--no-sync")
            self._initialized = True
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start")

    def stop(self) -> None:
        """A fast shutdown: connections are cut, as in an operator's restart."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.root, ignore_errors=True)
