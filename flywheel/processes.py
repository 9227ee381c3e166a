"""Start and stop Flywheel's own processes (engines now; proxy and trainer later) as child processes."""

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
    """A running child and where its output goes."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, timeout_s: float = 10.0) -> None:
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


def start_engine(
    config_path: str | None, overrides: Sequence[str], worker_index: int, log_dir: Path
) -> ChildProcess:
    """Run `flywheel engine` for one worker in a child process with the same config layers."""
    command = [sys.executable, "-m", "flywheel.cli"]
    if config_path:
        command += ["--config", config_path]
    command += ["engine", "--worker-index", str(worker_index), *overrides]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"engine-{worker_index}.log"
    with log_path.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    log.info("started engine %d (pid %d), log %s", worker_index, process.pid, log_path)
    return ChildProcess(f"engine-{worker_index}", process, log_path)
