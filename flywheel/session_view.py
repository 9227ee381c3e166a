"""What `flywheel sessions list|show` print: sessions as JSON-ready documents (rewards combined as the
finalizer combines them, rewards/finalize.py `combine_rewards`), and those documents as text tables, a
session's completions drawn as their conversation tree."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from flywheel.cli_support import at_text, format_table, iso, number_text
from rewards.finalize import RestAndHooks, RewardEntry, SessionRewards, combine_rewards
from rewards.snapshot import load_session_snapshot
from storage.engine import SessionFactory
from storage.export_queries import RUN_METADATA_KEY
from storage.ops_queries import SessionFilter, list_sessions, session_trajectories
from storage.records import CompletionRecord
from storage.reward_jobs import jobs_of_session
from storage.sequences import tree_order


def reward_total(rewards: SessionRewards) -> float | None:
    """The session's reward plus its completions' (each target combined); None when it has none."""
    if rewards.empty:
        return None
    return (rewards.session or 0.0) + sum(rewards.completions.values())


async def gather_sessions(
    session_factory: SessionFactory, filt: SessionFilter, rule: RestAndHooks
) -> list[dict[str, Any]]:
    """The sessions `filt` selects, newest first, as JSON-ready documents."""
    listed = []
    for s in await list_sessions(session_factory, filt):
        entries = [RewardEntry(value=r.value, source=r.source, completion_id=r.completion_id)
                   for r in s.rewards]
        listed.append({
            "session_id": s.id, "status": s.status, "group_id": s.group_id,
            "run": s.metadata.get(RUN_METADATA_KEY), "created_at": iso(s.created_at),
            "ended_at": iso(s.ended_at), "completions": s.completions, "output_tokens": s.output_tokens,
            "trajectories": s.trajectories, "reward": reward_total(combine_rewards(entries, rule)),
        })
    return listed


def session_list_text(listed: Sequence[dict[str, Any]]) -> str:
    """The listed sessions as a table."""
    rows = [("SESSION", "STATUS", "GROUP", "RUN", "CREATED (UTC)", "CALLS", "OUT TOKENS", "REWARD",
             "SAMPLES")]
    for s in listed:
        rows.append((
            s["session_id"], s["status"], s["group_id"] or "-", "-" if s["run"] is None else str(s["run"]),
            at_text(s["created_at"]), str(s["completions"]), str(s["output_tokens"]),
            number_text(s["reward"]), str(s["trajectories"]),
        ))
    return format_table(rows) if listed else "no sessions"


async def gather_session(
    session_factory: SessionFactory, session_id: str, rule: RestAndHooks
) -> dict[str, Any] | None:
    """One session as a JSON-ready document: its completions in tree order (`depth`, full prompt
    lengths), rewards, hook jobs and trajectories; None when there is no such session."""
    # Jobs first, as the RL API reads them: a job shown done has its rewards in the snapshot read after.
    jobs = await jobs_of_session(session_factory, session_id)
    snapshot = await load_session_snapshot(session_factory, session_id)
    if snapshot is None:
        return None
    samples = await session_trajectories(session_factory, session_id)
    combined = combine_rewards(snapshot.reward_entries(), rule)
    return {
        "session_id": snapshot.id, "status": snapshot.status, "group_id": snapshot.group_id,
        "task": snapshot.task, "metadata": snapshot.metadata, "created_at": iso(snapshot.created_at),
        "ended_at": iso(snapshot.ended_at),
        "reward": {"session": combined.session, "completions": dict(combined.completions),
                   "total": reward_total(combined)},
        "completions": [
            _completion_json(c, depth, prompt_tokens, combined.completions.get(c.id))
            for c, depth, prompt_tokens in tree_order(snapshot.completions)
        ],
        "rewards": [
            {"id": r.id, "completion_id": r.completion_id, "source": r.source, "value": r.value,
             "details": r.details, "created_at": iso(r.created_at)}
            for r in snapshot.rewards
        ],
        "hooks": [
            {"level": j.level, "source": j.source, "state": j.state, "attempts": j.attempts,
             "max_attempts": j.max_attempts, "error": j.error, "created_at": iso(j.created_at),
             "finished_at": iso(j.finished_at)}
            for j in jobs
        ],
        "trajectories": [
            {"id": t.id, "tokens": t.tokens, "trained_tokens": t.trained_tokens, "reward": t.reward,
             "min_version": t.min_version, "completion_ids": list(t.completion_ids), "claimed": t.claimed,
             "consumed_step": t.consumed_step}
            for t in samples
        ],
    }


def _completion_json(
    c: CompletionRecord, depth: int, prompt_tokens: int, reward: float | None
) -> dict[str, Any]:
    return {
        "id": c.id, "parent_id": c.parent_id, "depth": depth, "prompt_tokens": prompt_tokens,
        "completion_tokens": len(c.output_ids), "finish_reason": c.finish_reason,
        "versions": sorted({int(v) for v in c.output_versions}), "temperature": c.temperature,
        "branched": c.branched, "orphan_of": c.orphan_of, "reward": reward,
    }


def session_text(shown: dict[str, Any]) -> str:
    """One session as text: its fields, then tables of its completion tree, rewards, hook jobs and
    trajectories."""
    reward = shown["reward"]
    ended = "" if shown["ended_at"] is None else f" (ended {at_text(shown['ended_at'])})"
    head = [
        ("session", shown["session_id"]), ("status", shown["status"] + ended),
        ("group", shown["group_id"] or "-"), ("created", at_text(shown["created_at"])),
        ("task", _json(shown["task"])), ("metadata", _json(shown["metadata"])),
        ("reward", f"{number_text(reward['total'])} (session {number_text(reward['session'])}, "
                   f"{len(reward['completions'])} completion reward(s))"),
    ]
    parts = [format_table(head), _completions_table(shown["completions"])]
    if shown["rewards"]:
        parts.append(format_table([("REWARD", "TARGET", "SOURCE", "VALUE", "AT (UTC)")] + [
            (str(r["id"]), r["completion_id"] or "session", r["source"], f"{r['value']:g}",
             at_text(r["created_at"]))
            for r in shown["rewards"]
        ]))
    if shown["hooks"]:
        parts.append(format_table([("HOOK JOB", "LEVEL", "STATE", "ATTEMPTS", "ERROR")] + [
            (j["source"], j["level"], j["state"], f"{j['attempts']}/{j['max_attempts']}", j["error"] or "-")
            for j in shown["hooks"]
        ]))
    if shown["trajectories"]:
        parts.append(format_table([("TRAJECTORY", "TOKENS", "TRAINED", "REWARD", "MIN VERSION", "STATE")] + [
            (str(t["id"]), str(t["tokens"]), str(t["trained_tokens"]), f"{t['reward']:g}",
             str(t["min_version"]), _sample_state(t))
            for t in shown["trajectories"]
        ]))
    return "\n\n".join(parts)


def _completions_table(completions: Sequence[dict[str, Any]]) -> str:
    if not completions:
        return "no completions"
    rows = [("COMPLETION", "PROMPT", "OUTPUT", "FINISH", "VERSIONS", "TEMP", "REWARD")]
    for label, c in zip(_tree_labels(completions), completions, strict=True):
        versions = ",".join(map(str, c["versions"])) or "-"
        rows.append((label, str(c["prompt_tokens"]), str(c["completion_tokens"]), c["finish_reason"],
                     versions, f"{c['temperature']:g}", number_text(c["reward"])))
    return format_table(rows)


def _tree_labels(completions: Sequence[dict[str, Any]]) -> list[str]:
    """Each completion's id behind box-drawing branches (`├─ `, `└─ `) after its ancestors' rails."""
    labels = []
    for i, c in enumerate(completions):
        depth = c["depth"]
        if depth == 0:
            labels.append(c["id"])
            continue
        rails = "".join("│  " if _continues(completions, i, level) else "   " for level in range(1, depth))
        branch = "├─ " if _continues(completions, i, depth) else "└─ "
        labels.append(rails + branch + c["id"])
    return labels


def _continues(completions: Sequence[dict[str, Any]], index: int, depth: int) -> bool:
    """Whether another node at `depth` follows `index` before the tree climbs above `depth`."""
    for later in completions[index + 1:]:
        if later["depth"] < depth:
            return False
        if later["depth"] == depth:
            return True
    return False


def _sample_state(t: dict[str, Any]) -> str:
    if t["consumed_step"] is not None:
        return f"consumed by step {t['consumed_step']}"
    return "claimed" if t["claimed"] else "waiting"


def _json(value: Any) -> str:
    return "-" if value is None else json.dumps(value, ensure_ascii=False, sort_keys=True)
