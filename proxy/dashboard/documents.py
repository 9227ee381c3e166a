"""What every dashboard document is made of: times as ISO 8601 text, floats that JSON can carry (NaN
and ±inf become null), a session's rewards combined as the finalizer combines them, and the JSON
response itself (msgspec: NaN-free by construction, several times faster than json.dumps on the
token columns)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import msgspec
from fastapi.responses import Response

from rewards.finalize import RestAndHooks, RewardEntry, SessionRewards, combine_rewards
from storage.dashboard.labels import TaskLabel
from storage.ops_queries import StoredRewardValue


class DashboardJSON(Response):
    """A JSON answer that never fails on a non-finite float (msgspec writes null) and is not cached."""

    media_type = "application/json"

    def __init__(self, content: Any, status_code: int = 200) -> None:
        super().__init__(content, status_code, headers={"Cache-Control": "no-store"})

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


def iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def finite(value: float | None) -> float | None:
    """`value` when it is a finite number, else None."""
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def finite_dict(values: dict[str, Any]) -> dict[str, Any]:
    """A metrics dict with its non-finite numbers as None (other values as they are)."""
    return {k: finite(v) if isinstance(v, float) else v for k, v in values.items()}


def combined(rewards: Sequence[StoredRewardValue], rule: RestAndHooks) -> SessionRewards:
    entries = [RewardEntry(value=r.value, source=r.source, completion_id=r.completion_id) for r in rewards]
    return combine_rewards(entries, rule)


def reward_total(rewards: SessionRewards) -> float | None:
    """The session's reward plus its completions' (each target combined, as `flywheel sessions` shows
    it); None when it has none."""
    if rewards.empty:
        return None
    return (rewards.session or 0.0) + sum(rewards.completions.values())


def task_json(task: TaskLabel | None) -> dict[str, str] | None:
    return None if task is None else {"key": task.key, "text": task.text}


def reward_range(
    rule: RestAndHooks, low: float | None, high: float | None
) -> Callable[[Sequence[StoredRewardValue]], bool] | None:
    """Whether a session's rewards, combined, total within `low` … `high` (inclusive; a missing bound is
    open; a session without a reward never matches); None when both bounds are missing."""
    if low is None and high is None:
        return None

    def within(rewards: Sequence[StoredRewardValue]) -> bool:
        total = reward_total(combined(rewards, rule))
        return total is not None and (low is None or total >= low) and (high is None or total <= high)

    return within
