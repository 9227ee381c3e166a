"""Running the `flywheel` command line as a user does: a subprocess of this interpreter, its output
captured, with a timeout (a command that should refuse at once must not hang the suite)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def flywheel(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "flywheel.cli", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
