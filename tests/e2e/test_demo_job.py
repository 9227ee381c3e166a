"""The main job (`flywheel demo`) runs end to end as a user runs it: CLI, engine child process, client."""

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_demo_job_answers_with_tiny_model(tmp_path):
    env = dict(os.environ, FLYWHEEL_CACHE_DIR=str(tmp_path / "cache"))
    command = [
        sys.executable, "-m", "flywheel.cli", "demo",
        "serving.model=tiny", f"serving.port={free_port()}", f"run.dir={tmp_path / 'run'}",
        "serving.cpu.num_threads=1",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line.split(":", 1)[0]: line for line in result.stdout.splitlines() if ":" in line}
    assert lines["question"].startswith("question: Natalia")
    assert "answer:" in lines
    assert "weight_version default" in result.stdout
    assert (tmp_path / "run" / "logs" / "engine-0.log").exists()
