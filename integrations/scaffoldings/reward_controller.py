"""`FlywheelRewardController`: scores the samples of a problem and makes the rewards land on their
sessions, either by a server-side reward hook (named when the group is created; ending each session
lets the proxy's hook runner grade it, and the controller reads the reward back) or by a local reward
function whose value it posts over REST before ending the session. Its `scores` feed best-of-N."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from integrations.scaffoldings.api import Controller, Task
from integrations.scaffoldings.rl_tasks import (
    LOCAL_SOURCE,
    AwaitHookRewardTask,
    EndSessionTask,
    PostRewardTask,
)
from integrations.scaffoldings.sessions import (
    COMPLETION_ID,
    PROMPT_TOKEN_IDS,
    REWARD,
    REWARD_DETAILS,
    produced,
    results_of,
    session_id_of,
    task_data_of,
)

RewardFn = Callable[..., Any]
"""AReaL's shape: `reward_fn(prompt, completion, prompt_ids, completion_ids, **task_data)` → a float,
or (float, details dict)."""
Target = Literal["session", "completion"]


def prompt_text(task: Any) -> str:
    """The prompt a sample answered: a generation's input, or a chat's last user message."""
    if getattr(task, "input_str", None):
        return str(task.input_str)
    users = [m.content for m in getattr(task, "messages", []) or [] if m.role == "user" and m.content]
    return str(users[-1]) if users else ""


class FlywheelRewardController(Controller):
    """Exactly one of `hook` (a reward hook spec: `{"hook": "math", "args": {...}}`, or a built-in's
    name) or `reward_fn` (AReaL's signature, see `RewardFn`; rewards posted with `source` on the session,
    or with `target="completion"` on the sample's completion). After `process`, `scores` holds one number
    per task, −inf for a sample without a reward (its call failed, or the hook gave none)."""

    def __init__(
        self, *, hook: Mapping[str, Any] | str | None = None, reward_fn: RewardFn | None = None,
        source: str = LOCAL_SOURCE, target: Target = "session", hook_timeout_s: float = 600.0,
    ) -> None:
        super().__init__()
        if (hook is None) == (reward_fn is None):
            raise ValueError("give a FlywheelRewardController exactly one of hook= or reward_fn=")
        if target not in ("session", "completion"):
            raise ValueError(f"target must be 'session' or 'completion', got {target!r}")
        self.hook: dict[str, Any] | None = {"hook": hook} if isinstance(hook, str) else (
            None if hook is None else dict(hook))
        self.reward_fn = reward_fn
        self.source = source
        self.target = target
        self.hook_timeout_s = hook_timeout_s
        self.scores: list[float] | None = None

    @property
    def hook_source(self) -> str | None:
        """The source the hook's rewards are stored with: `hook:<name or hook>`."""
        if self.hook is None:
            return None
        return f"hook:{self.hook.get('name') or self.hook['hook']}"

    def session_hooks(self) -> list[dict[str, Any]]:
        """The `reward` of a new group: the hook, or none at all (so that no hook the proxy is configured
        with labels sessions a local function rewards)."""
        return [] if self.hook is None else [dict(self.hook)]

    def describe(self) -> str:
        return self.hook_source or f"local:{self.source}"

    def process(self, tasks: list[Task], **kwargs: Any) -> Any:
        missing = [i for i, task in enumerate(tasks) if session_id_of(task) is None]
        if missing:
            raise ValueError(f"samples {missing} have no Flywheel session: did they run on a FlywheelWorker?")
        if self.hook is not None:
            yield from self._graded_by_hook(tasks)
        else:
            yield from self._graded_locally(tasks)
        self.scores = [_score(results_of(task)[REWARD]) for task in tasks]

    def _graded_locally(self, tasks: list[Task]) -> Any:
        posts: list[Task] = []
        for task in tasks:
            fields = results_of(task)
            if not produced(task):
                fields[REWARD] = None
                continue
            value, details = self._reward_of(task)
            fields[REWARD], fields[REWARD_DETAILS] = value, details
            completion_id = fields.get(COMPLETION_ID) if self.target == "completion" else None
            posts.append(PostRewardTask(session_id=str(session_id_of(task)), completion_id=completion_id,
                                        value=value, source=self.source, details=details))
        if posts:
            yield posts
        yield _ends(tasks)

    def _reward_of(self, task: Any) -> tuple[float, dict[str, Any]]:
        assert self.reward_fn is not None
        prompt_ids = list(results_of(task).get(PROMPT_TOKEN_IDS) or [])
        output_ids = list(task.output_tokens or [])
        data = task_data_of(task)
        answer = self.reward_fn(prompt_text(task), task.output_str, prompt_ids, output_ids, **data)
        value, details = answer if isinstance(answer, tuple) else (answer, {})
        return float(value), dict(details)

    def _graded_by_hook(self, tasks: list[Task]) -> Any:
        yield _ends(tasks)
        waits = {id(task): AwaitHookRewardTask(session_id=str(session_id_of(task)),
                                               source=str(self.hook_source), timeout_s=self.hook_timeout_s)
                 for task in tasks if produced(task)}
        if waits:
            yield list(waits.values())
        for task in tasks:
            wait = waits.get(id(task))
            fields = results_of(task)
            fields[REWARD] = None if wait is None else wait.reward
            details = {} if wait is None else dict(wait.details)
            if wait is not None and wait.error:
                details["error"] = wait.error
            fields[REWARD_DETAILS] = details


def _ends(tasks: list[Task]) -> list[Task]:
    """One end per session (copies of a task may share one)."""
    ids = dict.fromkeys(str(session_id_of(task)) for task in tasks)
    return [EndSessionTask(session_id=session_id) for session_id in ids]


def _score(value: float | None) -> float:
    return -math.inf if value is None else value
