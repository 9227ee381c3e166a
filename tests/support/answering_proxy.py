"""A stand-in for a proxy's few read-only routes, for `flywheel status --proxy`: `GET /health` without a
key, and with the one key it knows `GET /v1/models` and `GET /rl/v1/policy` (others: 401). It runs on a
thread of its own on loopback and records the keys it was sent."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class AnsweringProxy:
    url: str
    key: str
    model: str
    policy_version: int
    keys_seen: list[str | None] = field(default_factory=list)


@contextmanager
def answering_proxy(key: str, model: str = "tiny", policy_version: int = 1) -> Iterator[AnsweringProxy]:
    """The stand-in, serving until the block ends."""
    state = AnsweringProxy(url="", key=key, model=model, policy_version=policy_version)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            bearer = self.headers.get("Authorization")
            state.keys_seen.append(bearer)
            if self.path == "/health":
                return self._answer(200, {"status": "ok"})
            if bearer != f"Bearer {state.key}":
                return self._answer(401, {"error": {"message": "bad key"}})
            if self.path == "/v1/models":
                return self._answer(200, {"object": "list", "data": [
                    {"id": state.model, "object": "model", "max_model_len": 512}]})
            if self.path == "/rl/v1/policy":
                return self._answer(200, {"policy_version": state.policy_version})
            return self._answer(404, {"error": {"message": "no route"}})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
