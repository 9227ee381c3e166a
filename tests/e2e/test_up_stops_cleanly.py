"""`flywheel up` stops every process it started when it is sent SIGTERM (as a process manager does)."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from serving.threaded_server import free_port

pytestmark = pytest.mark.e2e


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().split()[2] != "Z"


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(line) for line in out.split()]


def test_sigterm_stops_engine_proxy_hook_runner_and_trainer(tiny_model_dir, tmp_path):
    command = [
        sys.executable, "-m", "flywheel.cli", "up", f"serving.model={tiny_model_dir}",
        f"serving.port={free_port()}", f"proxy.port={free_port()}", f"run.dir={tmp_path / 'run'}",
        "serving.cpu.num_threads=1", "trainer.num_threads=1", "trainer.ray.num_cpus=1",
        f"trainer.ray.temp_dir={tempfile.mkdtemp(prefix='ray', dir='/tmp')}",  # short socket paths
    ]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in up.stdout:
            if line.startswith("admin key:"):
                break
        else:
            pytest.fail(f"flywheel up exited with {up.wait()} before it was ready")
        children = children_of(up.pid)
        assert len(children) == 4  # engine, proxy, reward hook runner, trainer
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if alive(pid)], "a child outlived flywheel up"
    finally:
        if up.poll() is None:
            up.kill()
