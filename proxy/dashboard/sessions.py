"""The dashboard's session documents: rows of the sessions table, one session's drill-down (its
conversation tree with branches flagged, each completion's generated tokens with their text, logprob and
policy version, its rewards, reward hook jobs and trajectories), and a page of one completion's tokens.
Token text comes from the proxy's own tokenizer, token by token, so a token's bytes show as the model
produced them; sizes are capped (`TokenBudget`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.dashboard.documents import combined, finite, iso, reward_total, task_json
from proxy.tokenize import ChatTokenizer
from rewards.finalize import RestAndHooks, combine_rewards
from rewards.snapshot import SessionSnapshot
from storage.dashboard.labels import run_label, task_label
from storage.dashboard.sessions import SessionRow
from storage.ops_queries import TrajectorySummary
from storage.records import CompletionRecord
from storage.reward_jobs import JobView
from storage.sequences import tree_order

MAX_TOKENS_PER_COMPLETION = 4096
"""The most tokens of one completion a document carries (a page of `completions/{id}/tokens`)."""
PROMPT_TEXT_TOKENS = 512
"""A completion's stored prompt is shown as the text of its last this many tokens."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenBudget:
    """How much of a session's tokens its drill-down carries: at most `per_completion` tokens of each
    completion, `total` over all of them, and `max_completions` completions (tree order)."""

    per_completion: int = 256
    total: int = 20_000
    max_completions: int = 500


def session_row_json(row: SessionRow, rule: RestAndHooks) -> dict[str, Any]:
    return {
        "session_id": row.id, "status": row.status, "group_id": row.group_id, "run": row.run,
        "task": task_json(row.task), "created_at": iso(row.created_at), "ended_at": iso(row.ended_at),
        "completions": row.completions, "output_tokens": row.output_tokens, "trajectories": row.trajectories,
        "reward": finite(reward_total(combined(row.rewards, rule))),
    }


def session_json(
    snapshot: SessionSnapshot, jobs: Sequence[JobView], samples: Sequence[TrajectorySummary],
    rule: RestAndHooks, tokenizer: ChatTokenizer, budget: TokenBudget,
) -> dict[str, Any]:
    """One session, whole: fields, combined reward, completions in tree order with tokens, rewards, hook
    jobs (with what they wrote) and trajectories."""
    rewards = combine_rewards(snapshot.reward_entries(), rule)
    ordered = tree_order(snapshot.completions)
    left = budget.total
    completions = []
    for c, depth, prompt_tokens in ordered[:budget.max_completions]:
        shown = max(min(budget.per_completion, left), 0)
        left -= min(shown, len(c.output_ids))
        completions.append({
            "id": c.id, "parent_id": c.parent_id, "depth": depth, "prompt_tokens": prompt_tokens,
            "completion_tokens": len(c.output_ids), "finish_reason": c.finish_reason,
            "versions": sorted({int(v) for v in c.output_versions}), "temperature": finite(c.temperature),
            "branched": c.branched, "orphan_of": c.orphan_of,
            "reward": finite(rewards.completions.get(c.id)),
            "prompt_text": prompt_text(tokenizer, c.prompt_ids),
            "tokens": token_columns(tokenizer, c, 0, shown),
        })
    return {
        "session_id": snapshot.id, "status": snapshot.status, "group_id": snapshot.group_id,
        "run": run_label(snapshot.metadata), "task": snapshot.task,
        "task_label": task_json(task_label(snapshot.task)), "metadata": snapshot.metadata,
        "created_at": iso(snapshot.created_at), "ended_at": iso(snapshot.ended_at),
        "reward": {"session": finite(rewards.session),
                   "completions": {k: finite(v) for k, v in rewards.completions.items()},
                   "total": finite(reward_total(rewards))},
        "completions_total": len(ordered),
        "completions": completions,
        "rewards": [
            {"id": r.id, "completion_id": r.completion_id, "source": r.source, "value": finite(r.value),
             "details": r.details, "created_at": iso(r.created_at)}
            for r in snapshot.rewards
        ],
        "hooks": [
            {"id": j.id, "level": j.level, "source": j.source, "state": j.state, "attempts": j.attempts,
             "max_attempts": j.max_attempts, "error": j.error, "result": j.result,
             "created_at": iso(j.created_at), "finished_at": iso(j.finished_at)}
            for j in jobs
        ],
        "trajectories": [
            {"id": t.id, "tokens": t.tokens, "trained_tokens": t.trained_tokens, "reward": finite(t.reward),
             "min_version": t.min_version, "completion_ids": list(t.completion_ids), "claimed": t.claimed,
             "consumed_step": t.consumed_step}
            for t in samples
        ],
    }


def token_columns(tokenizer: ChatTokenizer, c: CompletionRecord, offset: int, limit: int) -> dict[str, Any]:
    """Output tokens `offset` … `offset + limit` of a completion as columns: ids, their text (None for an
    id the tokenizer does not know), logprobs (None where not finite) and policy versions, exactly as
    stored."""
    total = len(c.output_ids)
    start = min(max(offset, 0), total)
    end = min(start + max(limit, 0), total)
    ids = np.asarray(c.output_ids, dtype=np.int64)[start:end].tolist()
    logprobs = np.asarray(c.output_logprobs, dtype=np.float32)[start:end].tolist()
    versions = np.asarray(c.output_versions, dtype=np.int64)[start:end].tolist()
    return {
        "offset": start, "total": total, "truncated": end < total or start > 0,
        "ids": ids, "texts": [_token_text(tokenizer, i) for i in ids],
        "logprobs": [finite(v) for v in logprobs], "versions": versions,
    }


def prompt_text(tokenizer: ChatTokenizer, prompt_ids: Any) -> dict[str, Any]:
    """The text of a completion's stored prompt (a child's: only the suffix it added), its last
    `PROMPT_TEXT_TOKENS` tokens when it is longer."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    tail = [int(i) for i in ids[-PROMPT_TEXT_TOKENS:] if 0 <= i < tokenizer.vocab_size]
    return {"text": tokenizer.decode(tail, skip_special_tokens=False), "tokens": int(ids.size),
            "truncated": ids.size > PROMPT_TEXT_TOKENS}


def _token_text(tokenizer: ChatTokenizer, token_id: int) -> str | None:
    if not 0 <= token_id < tokenizer.vocab_size:
        return None
    return tokenizer.token_text(token_id)
