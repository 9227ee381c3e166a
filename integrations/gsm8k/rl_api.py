"""A thin client of Flywheel's public RL control API (/rl/v1; docs/architecture.md, "Wire protocols")
over plain HTTP.

It knows only the proxy's root URL and a key; every failure becomes a `FlywheelAPIError` whose message
says what was called and what the proxy answered (its OpenAI-shaped error message), or that nothing
answered at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)


class FlywheelAPIError(RuntimeError):
    """A call to the proxy failed: unreachable, refused (401/403), or answered with an error."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True)
class SessionHandle:
    session_id: str
    api_key: str


@dataclass(frozen=True)
class GroupHandle:
    group_id: str
    sessions: list[SessionHandle]


def root_url_of(base_url: str) -> str:
    """The proxy's root from either its root or its OpenAI base URL: ".../v1" and trailing "/" go."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _error_message(response: httpx.Response) -> str:
    """The proxy's own words: `error.message` of an OpenAI-shaped body, else FastAPI's `detail`, else
    the raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            code = f" ({error['code']})" if error.get("code") else ""
            return f"{error['message']}{code}"
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]


class RLClient:
    """Create sessions and groups, reward and end sessions. Thread-safe (one pooled httpx.Client)."""

    def __init__(self, base_url: str, api_key: str, *, timeout_s: float = 30.0) -> None:
        self.root_url = root_url_of(base_url)
        self._http = httpx.Client(
            base_url=self.root_url, timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"}
        )

    def __enter__(self) -> RLClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    @property
    def openai_base_url(self) -> str:
        return f"{self.root_url}/v1"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.TransportError as error:
            raise FlywheelAPIError(
                f"cannot reach the Flywheel proxy at {self.root_url} ({type(error).__name__}: {error}); "
                "is it running, and is the URL right?"
            ) from error
        if response.status_code >= 400:
            hint = ""
            if response.status_code == 401:
                hint = " — check the API key (an admin key: `flywheel keys create --admin`)"
            elif response.status_code == 403:
                hint = " — this route needs an admin key"
            raise FlywheelAPIError(
                f"{method} {path} failed: HTTP {response.status_code}: {_error_message(response)}{hint}",
                response.status_code,
            )
        return response.json()

    def served_model(self) -> str:
        """The id of the model the proxy serves (GET /v1/models): also proves the proxy is up and the
        key works."""
        models = self._call("GET", "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not data:
            raise FlywheelAPIError(f"GET /v1/models at {self.root_url} listed no model: {models!r}")
        return str(data[0]["id"])

    def create_group(self, size: int, task: Any = None) -> GroupHandle:
        body = self._call("POST", "/rl/v1/groups", {"size": size, "task": task})
        sessions = [SessionHandle(s["session_id"], s["api_key"]) for s in body["sessions"]]
        return GroupHandle(body["group_id"], sessions)

    def create_session(self, task: Any = None, metadata: dict[str, Any] | None = None) -> SessionHandle:
        body = self._call("POST", "/rl/v1/sessions", {"task": task, "metadata": metadata or {}})
        return SessionHandle(body["session_id"], body["api_key"])

    def reward_session(
        self, session_id: str, value: float, source: str = "rest", details: dict[str, Any] | None = None
    ) -> None:
        body = {"value": value, "source": source, "details": details or {}}
        self._call("POST", f"/rl/v1/sessions/{session_id}/reward", body)

    def end_session(self, session_id: str) -> None:
        self._call("POST", f"/rl/v1/sessions/{session_id}/end")
