"""`FlywheelRLWorker`: runs the RL control API tasks of `rl_tasks` with an admin key over async HTTP, and
raises `FlywheelAPIError` (naming the call and the proxy's answer) when the proxy refuses one."""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

import httpx

from integrations.gsm8k.rl_api import FlywheelAPIError, root_url_of, unsettled_hooks
from integrations.scaffoldings.api import TaskStatus, Worker
from integrations.scaffoldings.rl_tasks import (
    AwaitHookRewardTask,
    EndSessionTask,
    FlywheelTag,
    OpenGroupTask,
    PostRewardTask,
)
from integrations.scaffoldings.sessions import SessionRef

MAX_POLL_INTERVAL_S = 2.0


def _proxy_message(response: httpx.Response) -> str:
    """The proxy's own words: an OpenAI-shaped `error.message`, else FastAPI's `detail`, else the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return str(body)[:500]


def hook_reward(view: dict[str, Any], source: str) -> tuple[float | None, dict[str, Any], str | None]:
    """(reward, details, error) that the settled hook jobs writing `source` left on a session view."""
    jobs = [job for job in view.get("hooks") or [] if job.get("source") == source]
    rows = [row for row in view.get("rewards") or []
            if row.get("source") == source and row.get("completion_id") is None]
    failed = [str(job.get("error")) for job in jobs if job.get("state") == "failed"]
    if failed:
        return None, {}, f"the hook writing {source} failed: {'; '.join(failed)}"
    if not jobs:
        return None, {}, f"the session has no hook writing {source} (was its group created with it?)"
    if not rows:
        return None, {}, f"the hook writing {source} gave no session reward"
    return float(rows[-1]["value"]), dict(rows[-1].get("details") or {}), None


class FlywheelRLWorker(Worker):
    """The `FlywheelTag.RL` role: groups, rewards, session ends and hook rewards, with an admin key."""

    WorkerTag = FlywheelTag

    def __init__(
        self, base_url: str, api_key: str, *, timeout_s: float = 30.0, poll_interval_s: float = 0.25
    ) -> None:
        self.root_url = root_url_of(base_url)
        self._api_key = api_key
        self._timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self._http: httpx.AsyncClient | None = None

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        if self._http is None:  # made on the event loop that runs the tasks
            self._http = httpx.AsyncClient(base_url=self.root_url, timeout=self._timeout_s,
                                           headers={"Authorization": f"Bearer {self._api_key}"})
        try:
            response = await self._http.request(method, path, json=body)
        except httpx.TransportError as error:
            raise FlywheelAPIError(f"cannot reach the Flywheel proxy at {self.root_url} "
                                   f"({type(error).__name__}: {error})") from error
        if response.status_code >= 400:
            raise FlywheelAPIError(f"{method} {path} failed: HTTP {response.status_code}: "
                                   f"{_proxy_message(response)}", response.status_code)
        return response.json()

    async def open_group(self, task: OpenGroupTask) -> TaskStatus:
        body: dict[str, Any] = {"size": task.size, "task": task.task}
        if task.reward is not None:
            body["reward"] = task.reward
        answer = await self._call("POST", "/rl/v1/groups", body)
        task.group_id = str(answer["group_id"])
        task.sessions = [SessionRef(s["session_id"], s["api_key"]) for s in answer["sessions"]]
        return TaskStatus.SUCCESS

    async def post_reward(self, task: PostRewardTask) -> TaskStatus:
        target = (f"/rl/v1/completions/{task.completion_id}" if task.completion_id
                  else f"/rl/v1/sessions/{task.session_id}")
        body = {"value": task.value, "source": task.source, "details": task.details}
        await self._call("POST", f"{target}/reward", body)
        return TaskStatus.SUCCESS

    async def end_session(self, task: EndSessionTask) -> TaskStatus:
        await self._call("POST", f"/rl/v1/sessions/{task.session_id}/end")
        return TaskStatus.SUCCESS

    async def await_hook_reward(self, task: AwaitHookRewardTask) -> TaskStatus:
        """Poll the session until its hook jobs writing `task.source` settle; FlywheelAPIError past
        `task.timeout_s` (is a hook runner running?)."""
        deadline = time.monotonic() + task.timeout_s
        path = f"/rl/v1/sessions/{task.session_id}"
        view = await self._call("GET", path)
        delay = self.poll_interval_s
        while pending := unsettled_hooks(view, [task.source]):
            if time.monotonic() >= deadline:
                states = ", ".join(str(job.get("state")) for job in pending)
                raise FlywheelAPIError(
                    f"the {task.source} hook of session {task.session_id} did not finish in "
                    f"{task.timeout_s:g} s ({states}); is a hook runner running, and can it keep up?")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, MAX_POLL_INTERVAL_S)  # many samples wait at once: poll less as it drags
            view = await self._call("GET", path)
        task.reward, task.details, task.error = hook_reward(view, task.source)
        return TaskStatus.SUCCESS

    async def async_shutdown(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    task_handlers: ClassVar[dict[type, Any]] = {
        OpenGroupTask: open_group,
        PostRewardTask: post_reward,
        EndSessionTask: end_session,
        AwaitHookRewardTask: await_hook_reward,
    }
