"""How a session is labelled on the dashboard: its run (the `run` key of its metadata, as `flywheel
sessions list` and `flywheel export` select it) and its task, grouped exactly as the trainer groups
singleton samples for their running baselines (storage/queries.py `baseline_key`), with a short text to
show."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from storage.export_queries import RUN_METADATA_KEY
from storage.queries import baseline_key

TASK_TEXT_CHARS = 60
"""The longest task text shown; the key keeps tasks that share a prefix apart."""

_TASK_NAME_KEYS = ("id", "task_id", "name", "task", "question", "prompt")


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskLabel:
    """A session's task: `key` groups equal tasks (a digest of the task's canonical JSON), `text` is what
    a person reads."""

    key: str
    text: str


def run_label(metadata: dict[str, Any] | None) -> str | None:
    """The session's run, as text (a number label reads as its digits); None when it has none."""
    value = (metadata or {}).get(RUN_METADATA_KEY)
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def task_label(task: Any) -> TaskLabel | None:
    """The session's task as a key and a short text; None when it has no task."""
    key = baseline_key(task, None)
    if key is None:
        return None
    return TaskLabel(key=key, text=_shorten(_task_text(task)))


def _task_text(task: Any) -> str:
    """A string task itself; a mapping's first name-like field (`id`, `name`, `question`, …) when it
    is a string or a number; else the compact JSON."""
    if isinstance(task, str):
        return task
    if isinstance(task, dict):
        for name in _TASK_NAME_KEYS:
            value = task.get(name)
            if isinstance(value, str) or (isinstance(value, int | float) and not isinstance(value, bool)):
                return str(value)
    return json.dumps(task, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _shorten(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= TASK_TEXT_CHARS else text[: TASK_TEXT_CHARS - 1] + "…"
