"""Run a uvicorn server in a daemon thread (tests, benchmarks, in-process stacks): one helper for the
engine and the proxy."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on `host` now (another process may still take it first)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@contextmanager
def serve_config_in_thread(
    config: uvicorn.Config, startup_timeout_s: float = 60.0, shutdown_timeout_s: float = 60.0
) -> Iterator[str]:
    """Start `uvicorn.Server(config)` in a daemon thread; yield `http://host:port` once it listens;
    on exit ask it to stop (open streams finish first) and wait for the thread."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{config.port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on {config.host}:{config.port}")
        time.sleep(0.01)
    try:
        yield f"http://{config.host}:{config.port}"
    finally:
        server.should_exit = True
        thread.join(shutdown_timeout_s)
