"""The dashboard's chart documents, built from storage's records (storage/dashboard/): the run's state at
a glance, reward curves per run or per task, policy versions, staleness histograms and throughput.
Pure functions: the routes read, these shape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from proxy.dashboard.documents import combined, finite, finite_dict, iso, reward_total
from rewards.finalize import RestAndHooks
from storage.dashboard.rewards import RewardedSession
from storage.dashboard.throughput import Counts, Throughput
from storage.dashboard.training import Staleness, VersionRow
from storage.models import JobState, SessionStatus, VersionStatus
from storage.ops_queries import Backlog, TrainProgress
from storage.policy_versions import VersionInfo

SeriesBy = Literal["run", "task"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyState:
    """The versions that matter now (each None before there is one)."""

    served: VersionInfo | None
    best: VersionInfo | None
    newest: VersionInfo | None


def summary_json(
    now: datetime, backlog: Backlog, progress: TrainProgress, policy: PolicyState
) -> dict[str, Any]:
    """What waits where, what the trainer did and which versions are served, best and newest."""
    return {
        "now": iso(now),
        "policy": {
            "served": _version_info(policy.served), "best": _version_info(policy.best),
            "newest": _version_info(policy.newest),
            "versions": {s.value: backlog.policy_versions.get(s.value, 0) for s in VersionStatus},
        },
        "trainer": {
            "steps": progress.steps, "last_step": progress.last_step,
            "last_step_version": progress.last_step_version, "last_step_at": iso(progress.last_step_at),
        },
        "sessions": {s.value: backlog.sessions.get(s.value, 0) for s in SessionStatus},
        "groups": backlog.groups,
        "completions": backlog.completions,
        "last_completion_at": iso(backlog.last_completion_at),
        "trajectories": {
            "total": backlog.trajectories, "unconsumed": backlog.unconsumed, "claimed": backlog.claimed,
            "consumed": backlog.trajectories - backlog.unconsumed - backlog.dropped,
            "dropped": backlog.dropped,
        },
        "reward_jobs": {s.value: backlog.reward_jobs.get(s.value, 0) for s in JobState},
    }


def _version_info(info: VersionInfo | None) -> dict[str, Any] | None:
    if info is None:
        return None
    return {**info.as_json(), "eval_score": finite(info.eval_score)}


def reward_series_json(
    sessions: Sequence[RewardedSession], rule: RestAndHooks, by: SeriesBy, max_series: int
) -> dict[str, Any]:
    """One series per run (or task) of the sessions' combined rewards in time order; the `max_series`
    with most points, the others counted in `other_series`."""
    series: dict[str | None, dict[str, Any]] = {}
    for s in sessions:
        total = reward_total(combined(s.rewards, rule))
        if total is None or finite(total) is None:
            continue
        key = s.run if by == "run" else (None if s.task is None else s.task.key)
        label = s.run if by == "run" else (None if s.task is None else s.task.text)
        entry = series.setdefault(
            key, {"key": key, "label": label, "times": [], "rewards": [], "sessions": []}
        )
        entry["times"].append(s.at.timestamp())
        entry["rewards"].append(total)
        entry["sessions"].append(s.id)
    ranked = sorted(series.values(), key=lambda e: (-len(e["rewards"]), str(e["key"])))
    shown = [_with_stats(entry) for entry in ranked[:max_series]]
    return {"by": by, "points": sum(len(e["rewards"]) for e in shown), "series": shown,
            "other_series": max(len(ranked) - max_series, 0)}


def _with_stats(entry: dict[str, Any]) -> dict[str, Any]:
    rewards = entry["rewards"]
    return {**entry, "count": len(rewards), "mean": sum(rewards) / len(rewards), "last": rewards[-1]}


def versions_json(
    rows: Sequence[VersionRow], truncated: bool, policy: PolicyState, metric_keys: Sequence[str]
) -> dict[str, Any]:
    """Versions newest first with status, evaluation and their step's metrics (only `metric_keys`,
    when given)."""
    marks = {
        "served": None if policy.served is None else policy.served.version,
        "best": None if policy.best is None else policy.best.version,
        "newest": None if policy.newest is None else policy.newest.version,
    }
    return {
        **marks,
        "truncated": truncated,
        "versions": [
            {
                "version": r.version, "status": r.status, "parent_version": r.parent_version,
                "eval_score": finite(r.eval_score), "eval_items": r.eval_items, "reason": r.reason,
                "served_at": iso(r.served_at), "created_at": iso(r.created_at), "step": r.step,
                "metrics": finite_dict(
                    {k: v for k, v in r.step_metrics.items() if not metric_keys or k in metric_keys}
                ),
                "is_served": r.version == marks["served"], "is_best": r.version == marks["best"],
            }
            for r in rows
        ],
    }


def staleness_json(found: Staleness, max_lag: int) -> dict[str, Any]:
    """Both histograms as `[{lag, count}]` by lag, lags from `max_lag` up in one last bucket marked
    `or_more`."""
    return {
        "current_version": found.current_version, "steps": found.steps, "first_step": found.first_step,
        "trained": lag_buckets(found.trained, max_lag), "waiting": lag_buckets(found.waiting, max_lag),
    }


def lag_buckets(histogram: dict[int, int], max_lag: int) -> list[dict[str, Any]]:
    """Every lag from 0 to the largest seen (zeros included, so bars line up), capped at `max_lag`."""
    if not histogram:
        return []
    capped: dict[int, int] = {}
    for lag, count in histogram.items():
        capped[min(lag, max_lag)] = capped.get(min(lag, max_lag), 0) + count
    top = max(capped)
    return [
        {"lag": lag, "count": capped.get(lag, 0), **({"or_more": True} if lag == max_lag else {})}
        for lag in range(top + 1)
    ]


def throughput_json(found: Throughput) -> dict[str, Any]:
    """Per window: counts and rates per second; the series as columns of per-bucket counts."""
    return {
        "now": iso(found.now),
        "windows": [
            {"seconds": seconds, **_counts(c),
             "completions_per_s": c.completions / seconds, "tokens_per_s": c.output_tokens / seconds,
             "hook_jobs_per_s": c.hook_jobs / seconds, "trajectories_per_s": c.trajectories / seconds}
            for seconds, c in sorted(found.windows.items())
        ],
        "series": {
            "start": iso(found.start), "bucket_s": found.bucket_s,
            **{name: [_counts(c)[name] for c in found.series]
               for name in ("completions", "output_tokens", "hook_jobs", "trajectories")},
        },
    }


def _counts(c: Counts) -> dict[str, int]:
    return {"completions": c.completions, "output_tokens": c.output_tokens, "hook_jobs": c.hook_jobs,
            "trajectories": c.trajectories}
