"""What reward hook tests hand a hook: completion views, a session whose answer is some text, and a context
whose process pool fails the test if a hook that must not use it does."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx

from rewards.hooks.contract import CompletionView, HookContext, HookPool, SessionInput

QUESTION = ({"role": "user", "content": "question"},)


def completion_view(
    id: str = "c1", text: str = "", *, parent_id: str | None = None,
    messages: Sequence[dict[str, Any]] = QUESTION, trainable: bool = True,
) -> CompletionView:
    """A recorded completion that answered `messages` with `text`."""
    return CompletionView(
        id=id, parent_id=parent_id, messages=tuple(messages), message={"role": "assistant", "content": text},
        text=text, prompt_ids=(1, 2, 3), output_ids=(4, 5), finish_reason="stop", trainable=trainable,
    )


def answered(
    text: str, *, task: Any = None, session_id: str = "s1", group_id: str | None = None,
    before: Sequence[CompletionView] = (), **metadata: Any,
) -> SessionInput:
    """A session whose final completion (after `before`) answers `text`; `metadata` as the agent attached
    it (`answer=...`)."""
    final = completion_view(f"c{len(before) + 1}", text)
    return SessionInput(session_id=session_id, group_id=group_id, task=task, metadata=metadata,
                        completions=(*before, final))


class NoPool:
    """For hooks that never use the process pool: touching it fails the test."""

    def __init__(self, who: str = "the hook") -> None:
        self.who = who

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        raise AssertionError(f"{self.who} used the process pool")


def hook_context(
    http: httpx.AsyncClient, pool: HookPool | None = None, *, job_id: str = "job-1", attempt: int = 1,
    timeout_s: float = 60.0,
) -> HookContext:
    """A context as the runner gives one (`pool` None: a NoPool)."""
    return HookContext(job_id=job_id, attempt=attempt, timeout_s=timeout_s, pool=pool or NoPool(), http=http)
