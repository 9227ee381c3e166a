"""A hook's answer as reward rows (pure): checked against the session or group it labelled, weighted by the
hook's `weight`.

A stored hook reward's `value` is the weighted one (so hook rewards on one target simply add up to their
weighted sum); its details keep the hook's own value (`raw`) and the `weight`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rewards.hooks.contract import GroupInput, GroupResult, HookResult, SessionInput
from storage.reward_jobs import RewardRow


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How one run of a job ended, and the sessions it labelled."""

    state: Literal["done", "retry", "failed", "lost"]
    session_ids: tuple[str, ...]


def _value(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _details(raw: float, weight: float, extra: Mapping[str, Any]) -> dict[str, Any]:
    return {**dict(extra), "raw": raw, "weight": weight}


def session_rows(result: HookResult, session: SessionInput, weight: float) -> list[RewardRow]:
    """The rows of one session's labels; a completion id not of this session is a ValueError."""
    rows: list[RewardRow] = []
    if result.session is not None:
        raw = _value(result.session, "a session reward")
        rows.append(RewardRow(value=raw * weight, session_id=session.session_id,
                              details=_details(raw, weight, result.details)))
    known = {completion.id for completion in session.completions}
    for completion_id, value in result.completions.items():
        if completion_id not in known:
            raise ValueError(f"the hook rewarded completion {completion_id!r}, which is not in session "
                             f"{session.session_id}")
        raw = _value(value, f"the reward of completion {completion_id}")
        rows.append(RewardRow(value=raw * weight, completion_id=completion_id,
                              details=_details(raw, weight, result.details)))
    return rows


def reward_rows(
    result: HookResult | GroupResult | None, subject: SessionInput | GroupInput, weight: float
) -> tuple[list[RewardRow], dict[str, Any]]:
    """The reward rows to write for `result`, and a summary for the job's `result` column."""
    if result is None:
        return [], {"opinion": False}
    if isinstance(subject, GroupInput):
        if not isinstance(result, GroupResult):
            raise TypeError(f"a group hook must answer a GroupResult or None, not {type(result).__name__}")
        members = {session.session_id: session for session in subject.sessions}
        rows = []
        for session_id, labels in result.sessions.items():
            if session_id not in members:
                raise ValueError(f"the hook labelled session {session_id!r}, which is not in group "
                                 f"{subject.group_id}")
            rows.extend(session_rows(labels, members[session_id], weight))
        return rows, {"opinion": bool(rows), "rewards": len(rows)}
    if not isinstance(result, HookResult):
        raise TypeError(f"a session hook must answer a HookResult or None, not {type(result).__name__}")
    rows = session_rows(result, subject, weight)
    summary: dict[str, Any] = {"opinion": bool(rows), "rewards": len(rows)}
    if result.session is not None:
        summary["session"] = float(result.session)
    return rows, summary

