"""The reward hook contract: what a hook is given, what it answers, and what it may use.

A hook labels a finished session (a session hook) or a whole group of sessions (a group hook):
- it is given a `SessionInput` (or a `GroupInput`): each completion as messages and as token ids, plus the
  task and metadata the agent attached when it opened the session (e.g. `{"answer": "42"}`), and the
  feedback its users gave so far;
- it answers a `HookResult` (a session reward, per-completion rewards, or both), a `GroupResult` (one
  `HookResult` per session), or None: no opinion (the session is labelled by the other hooks, or follows
  the finalizer's missing-reward rule);
- it may use the `HookContext`: a process pool with a hard per-item timeout for CPU-bound graders, an HTTP
  client, the job's idempotency key, and how long it has.

Hooks run off the request path, from a durable queue of jobs (rewards/jobs.py); a hook that raises or
runs past its timeout is retried with backoff and, past its attempt limit, marked failed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

HookLevel = Literal["session", "group"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionView:
    """One recorded completion, as a hook sees it."""

    id: str
    parent_id: str | None
    messages: tuple[dict[str, Any], ...]
    """The whole prompt as chat messages, history included (a legacy completion's prompt is one user
    message; a Responses API call's `instructions` a system message)."""
    message: dict[str, Any]
    """The generated assistant message: `role`, `content`, and `tool_calls` when it called tools."""
    text: str
    """The generated text (the message's content; "" when it only called tools)."""
    prompt_ids: tuple[int, ...]
    """The whole prompt's token ids, history included."""
    output_ids: tuple[int, ...]
    finish_reason: str
    trainable: bool
    """False for what the finalizer does not train on (aborted, empty or unversioned output): a reward on
    it is ignored."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FeedbackView:
    """One user feedback on one of the session's completions (`POST /rl/v1/feedback`)."""

    completion_id: str
    value: float | None
    """What it counts as: the value given, or a thumbs' configured value; None for a comment alone."""
    thumbs: str | None
    """"up", "down", or None."""
    comment: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInput:
    """A finished session: its completions in call order, what the agent said about its task, and what
    its users said about its answers."""

    session_id: str
    group_id: str | None
    task: Any
    metadata: Mapping[str, Any]
    completions: tuple[CompletionView, ...]
    feedback: tuple[FeedbackView, ...] = ()
    """Its users' feedback so far, in arrival order."""

    @property
    def final(self) -> CompletionView | None:
        """The session's last trainable completion (its answer), else its last one; None without any."""
        for completion in reversed(self.completions):
            if completion.trainable:
                return completion
        return self.completions[-1] if self.completions else None

    @property
    def answer_text(self) -> str:
        """The final completion's text ("" for a session without completions)."""
        final = self.final
        return "" if final is None else final.text

    def expected(self, key: str = "answer") -> Any:
        """The reference the agent attached: `metadata[key]`, else `task[key]` when the task is an object;
        None when neither has it."""
        if key in self.metadata:
            return self.metadata[key]
        if isinstance(self.task, Mapping):
            return self.task.get(key)
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupInput:
    """A group whose sessions have all ended (a GRPO group: several attempts at one task)."""

    group_id: str
    task: Any
    sessions: tuple[SessionInput, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HookResult:
    """A hook's labels for one session: its reward and/or rewards of single completions (by id).
    `details` is stored beside the reward (a judge's reasoning, the extracted answer)."""

    session: float | None = None
    completions: Mapping[str, float] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return self.session is None and not self.completions


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupResult:
    """A group hook's labels, per session id (a session it has no opinion on is left out)."""

    sessions: Mapping[str, HookResult]


class HookTimeoutError(TimeoutError):
    """A hook, or one item of its work in the process pool, ran past its limit (the worker is killed)."""


class HookPool(Protocol):
    """Worker processes for CPU-bound grading: `run(fn, *args, timeout_s=…)` runs `fn(*args)` (a module-level
    function, picklable arguments) in a worker process; past `timeout_s` the worker is killed and replaced
    and HookTimeoutError is raised. Never SIGALRM, never a thread that cannot be stopped."""

    async def run(self, fn: Callable[..., T], *args: Any, timeout_s: float) -> T: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class HookContext:
    """What a running hook may use."""

    job_id: str
    """Stable across the job's retries: the idempotency key of anything the hook sends out."""
    attempt: int
    """1 on the first run, 2 on the first retry, …"""
    timeout_s: float
    """The job's limit: the runner cancels the hook past it."""
    pool: HookPool
    http: Any
    """An `httpx.AsyncClient` shared by the runner's hooks (no base URL)."""


class Hook(Protocol):
    """A hook bound to its arguments. `level` says whether it labels one session or a whole group."""

    level: HookLevel

    def __call__(
        self, subject: SessionInput | GroupInput, context: HookContext
    ) -> Awaitable[HookResult | GroupResult | None]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class HookFactory:
    """A hook as the registry knows it: its name, its level, the pydantic model of its arguments (checked
    when the proxy starts or a session names it: unknown fields are errors), and how to build it."""

    name: str
    level: HookLevel
    args: type[Any]
    """A pydantic model with `extra="forbid"`."""
    build: Callable[[Any], Hook]
    """Called with a validated `args` instance."""
    summary: str
    """One line for `flywheel rewards hooks` and error messages."""
