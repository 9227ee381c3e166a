"""A thin client of Flywheel's public RL control API (/rl/v1; docs/architecture.md, "Wire protocols")
over plain HTTP.

It knows only the proxy's root URL and a key; every failure becomes a `FlywheelAPIError` whose message
says what was called and what the proxy answered (its OpenAI-shaped error message), or that nothing
answered at all. A 429 with `Retry-After` (admission control refusing a new session until training
catches up, or a rate limit) is waited out and the call made again, as the `openai` client does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)

SETTLED_HOOK_STATES = frozenset({"done", "failed"})
"""A reward hook's job in one of these states will not change again: its rewards (if any) are written."""


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


MAX_RETRY_AFTER_S = 60.0
"""The longest single wait a 429's `Retry-After` is taken at."""


def retry_after_s(response: httpx.Response) -> float | None:
    """How long a 429 asks to wait: `retry-after-ms`, else `Retry-After` in seconds (at most
    MAX_RETRY_AFTER_S); None for any other answer, or a 429 that says nothing (it is not retried)."""
    if response.status_code != 429:
        return None
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = response.headers.get(name)
        try:
            seconds = float(value) * scale if value is not None else None
        except ValueError:  # an HTTP date: not sent by Flywheel
            seconds = None
        if seconds is not None and seconds >= 0:
            return min(seconds, MAX_RETRY_AFTER_S)
    return None


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


def _hooks_of(view: dict[str, Any], sources: Iterable[str] | None) -> list[dict[str, Any]]:
    """The hook jobs of a session view (GET /rl/v1/sessions/{id}); only those writing one of `sources`
    when given."""
    wanted = None if sources is None else set(sources)
    return [job for job in view.get("hooks") or [] if wanted is None or job.get("source") in wanted]


def unsettled_hooks(view: dict[str, Any], sources: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """The hook jobs of a session view (GET /rl/v1/sessions/{id}) still queued or running; only those
    writing one of `sources` when given."""
    return [job for job in _hooks_of(view, sources) if job.get("state") not in SETTLED_HOOK_STATES]


def _with_reward(body: dict[str, Any], reward: Any) -> dict[str, Any]:
    """A creation request naming `reward` hooks; without the field (the configured hooks) for None."""
    return body if reward is None else {**body, "reward": reward}


class RLClient:
    """Create sessions and groups, reward and end sessions, read them back. Thread-safe (one pooled
    httpx.Client). A call refused with 429 and `Retry-After` is made again after that wait, for up to
    `max_wait_s` in all (a refused call wrote nothing, so repeating it is safe)."""

    def __init__(
        self, base_url: str, api_key: str, *, timeout_s: float = 30.0, max_wait_s: float = 3600.0
    ) -> None:
        self.root_url = root_url_of(base_url)
        self.max_wait_s = max_wait_s
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
        waited = 0.0
        response = self._send(method, path, body)
        while (wait := retry_after_s(response)) is not None and waited + wait <= self.max_wait_s:
            logger.info("%s %s: 429, again in %.1f s: %s", method, path, wait, _error_message(response))
            time.sleep(wait)
            waited += wait
            response = self._send(method, path, body)
        if response.status_code >= 400:
            hint = ""
            if response.status_code == 401:
                hint = " — check the API key (an admin key: `flywheel keys create --admin`)"
            elif response.status_code == 403:
                hint = " — this route needs an admin key"
            elif response.status_code == 429 and waited:
                hint = f" — still refused after waiting {waited:.0f} s"
            raise FlywheelAPIError(
                f"{method} {path} failed: HTTP {response.status_code}: {_error_message(response)}{hint}",
                response.status_code,
            )
        return response.json()

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
        try:
            return self._http.request(method, path, json=body)
        except httpx.TransportError as error:
            raise FlywheelAPIError(
                f"cannot reach the Flywheel proxy at {self.root_url} ({type(error).__name__}: {error}); "
                "is it running, and is the URL right?"
            ) from error

    def served_model(self) -> str:
        """The id of the model the proxy serves (GET /v1/models): also proves the proxy is up and the
        key works."""
        return str(self.served_model_entry()["id"])

    def served_model_entry(self) -> dict[str, Any]:
        """The served model's entry of GET /v1/models: its `id` and `max_model_len` (its context)."""
        models = self._call("GET", "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not data or not isinstance(data[0], dict):
            raise FlywheelAPIError(f"GET /v1/models at {self.root_url} listed no model: {models!r}")
        return data[0]

    def send_feedback(
        self, completion_id: str | None = None, *, value: float | None = None, thumbs: str | None = None,
        comment: str | None = None,
    ) -> dict[str, Any]:
        """A judgement of a completion (POST /rl/v1/feedback; None: the key's newest completion); the
        proxy's answer says whether it joined training."""
        body = {"completion_id": completion_id, "value": value, "thumbs": thumbs, "comment": comment}
        answer = self._call("POST", "/rl/v1/feedback", {k: v for k, v in body.items() if v is not None})
        return dict(answer)

    def create_group(self, size: int, task: Any = None, reward: Any = None) -> GroupHandle:
        """A group of `size` sessions. `reward` names the reward hooks that label each session once it
        ends (`{"hook": "math", "args": {...}}` or a list of such); None: the proxy's configured hooks;
        []: none."""
        body = self._call("POST", "/rl/v1/groups", _with_reward({"size": size, "task": task}, reward))
        sessions = [SessionHandle(s["session_id"], s["api_key"]) for s in body["sessions"]]
        return GroupHandle(body["group_id"], sessions)

    def create_session(
        self, task: Any = None, metadata: dict[str, Any] | None = None, reward: Any = None
    ) -> SessionHandle:
        """A session outside any group; `reward` as for `create_group`."""
        body = self._call("POST", "/rl/v1/sessions",
                          _with_reward({"task": task, "metadata": metadata or {}}, reward))
        return SessionHandle(body["session_id"], body["api_key"])

    def session(self, session_id: str) -> dict[str, Any]:
        """The session as the proxy sees it: status, completions, `rewards` and reward `hooks` jobs."""
        view = self._call("GET", f"/rl/v1/sessions/{session_id}")
        if not isinstance(view, dict):
            raise FlywheelAPIError(f"GET /rl/v1/sessions/{session_id} gave {view!r}; expected an object")
        return view

    def wait_for_hooks(
        self, session_id: str, timeout_s: float, *, sources: Iterable[str] | None = None,
        interval_s: float = 0.25,
    ) -> dict[str, Any]:
        """The session's view once every one of its reward hook jobs (only those writing one of
        `sources`, when given) is done or failed: its `rewards` then hold what they wrote. Call it
        after ending the session (its hook jobs are queued when it ends). FlywheelAPIError when some
        are still queued or running after `timeout_s`."""
        wanted = None if sources is None else tuple(sources)
        deadline = time.monotonic() + timeout_s
        view = self.session(session_id)
        pending = unsettled_hooks(view, wanted)
        while pending:
            if time.monotonic() >= deadline:
                states = ", ".join(f"{job.get('source')}: {job.get('state')}" for job in pending)
                raise FlywheelAPIError(
                    f"the reward hooks of session {session_id} did not finish in {timeout_s:g} s ({states}); "
                    "is a hook runner running (the proxy's own, rewards.runner.in_proxy, or "
                    "`flywheel rewards`), and can it keep up?"
                )
            time.sleep(interval_s)
            view = self.session(session_id)
            pending = unsettled_hooks(view, wanted)
        return view

    def reward_session(
        self, session_id: str, value: float, source: str = "rest", details: dict[str, Any] | None = None
    ) -> None:
        body = {"value": value, "source": source, "details": details or {}}
        self._call("POST", f"/rl/v1/sessions/{session_id}/reward", body)

    def end_session(self, session_id: str) -> None:
        self._call("POST", f"/rl/v1/sessions/{session_id}/end")
