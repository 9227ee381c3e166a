"""Start and stop Flywheel's own processes (engines, proxy, trainer, agents) as child processes."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class ChildProcess:
    """A running child and the file its output goes to."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s` (a trainer finishes its step in flight first)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", self.name, timeout_s)
                self.process.kill()
                self.process.wait()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def flywheel_command(
    command: str, config_path: str | None, overrides: Sequence[str], *extra: str
) -> list[str]:
    """`python -m flywheel.cli [--config F] COMMAND [extra...] [overrides...]` for this interpreter."""
    argv = [sys.executable, "-m", "flywheel.cli"]
    if config_path:
        argv += ["--config", config_path]
    return [*argv, command, *extra, *overrides]


def start_child(name: str, argv: Sequence[str], log_dir: Path) -> ChildProcess:
    """Start `argv` with stdout and stderr appended to `<log_dir>/<name>.log`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as out:
        process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT)
    log.info("started %s (pid %d), log %s", name, process.pid, log_path)
    return ChildProcess(name, process, log_path)


def start_engine(
    config_path: str | None, overrides: Sequence[str], worker_index: int, log_dir: Path
) -> ChildProcess:
    """Run `flywheel engine` for one worker in a child process with the same config layers."""
    argv = flywheel_command("engine", config_path, overrides, "--worker-index", str(worker_index))
    return start_child(f"engine-{worker_index}", argv, log_dir)
