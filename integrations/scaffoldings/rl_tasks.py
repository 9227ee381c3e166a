"""Tasks for Flywheel's RL control API (/rl/v1), run by `FlywheelRLWorker` under the `FlywheelTag.RL`
role, so controllers open groups, post rewards and end sessions by yielding tasks like any other."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from integrations.scaffoldings.api import Task
from integrations.scaffoldings.sessions import SessionRef

LOCAL_SOURCE = "scaffolding"
"""The source of rewards computed by a local reward function."""


class FlywheelTag(Enum):
    RL = "flywheel_rl"


@dataclass
class OpenGroupTask(Task):
    """`POST /rl/v1/groups`: `size` sessions attempting `task`, labelled by `reward` hooks when they end
    (None: the proxy's configured hooks; []: none). Fills `group_id` and `sessions`."""

    worker_tag: Any = FlywheelTag.RL
    size: int = 1
    task: Any = None
    reward: Any = None
    group_id: str | None = None
    sessions: list[SessionRef] = field(default_factory=list)


@dataclass
class PostRewardTask(Task):
    """`POST /rl/v1/sessions/{id}/reward`, or `/rl/v1/completions/{id}/reward` with `completion_id`."""

    worker_tag: Any = FlywheelTag.RL
    session_id: str = ""
    completion_id: str | None = None
    value: float = 0.0
    source: str = LOCAL_SOURCE
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class EndSessionTask(Task):
    """`POST /rl/v1/sessions/{id}/end` (idempotent): the session's hooks run and it may be finalized."""

    worker_tag: Any = FlywheelTag.RL
    session_id: str = ""


@dataclass
class AwaitHookRewardTask(Task):
    """Wait until the ended session's hook jobs writing `source` have settled, then read their session
    reward: `reward` (None, with `error`, when the hook failed or gave none) and its `details`."""

    worker_tag: Any = FlywheelTag.RL
    session_id: str = ""
    source: str = "hook:math"
    timeout_s: float = 600.0
    reward: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
