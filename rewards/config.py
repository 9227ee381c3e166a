"""Reward configuration: how rewards become trajectory rewards and when sessions are finalized
(`FinalizerConfig`), which reward hooks label sessions and how they run (`RewardsConfig`), and how user
feedback becomes a reward (`FeedbackConfig`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rewards.hooks.spec import SOURCE_PREFIX, HookSpec


class FinalizerConfig(BaseModel):
    """How the session finalizer turns a session's completions and rewards into trajectories."""

    model_config = ConfigDict(extra="forbid")

    style: Literal["concatenated", "individual"] = "concatenated"
    """"concatenated": one trajectory per conversation chain (root → leaf), its outputs trained and the
    prompt suffixes between them (tool results, user turns) masked (rewards/concatenate.py).
    "individual": one trajectory per trainable completion (its full prompt masked, its output
    trained)."""
    turn_discount: float = Field(1.0, ge=0.0, le=1.0)
    """"individual" style only: γ of `R_i = r_i + γ·R_{i+1}`, walking back over a session's trainable
    completions in call order. 1.0 gives every turn the whole session's reward; 0.0 keeps each turn's
    own reward."""
    missing_reward: Literal["zero", "drop"] = "zero"
    """A session finalized with no reward at all: "zero" trains on it with reward 0 (AReaL's behaviour),
    "drop" writes no trajectories for it. Either way a warning is logged. A session's own metadata key
    "missing_reward" overrides this (the proxy's one-off admin-call sessions say "drop")."""
    reward_grace_s: float = Field(60.0, ge=0.0)
    """How long an ended session without any reward waits for one before the sweep finalizes it under
    `missing_reward` (a driver may end a session first and post its reward afterwards)."""
    session_ttl_s: float = Field(3600.0, gt=0.0)
    """A session still active this long after it was created is ended and finalized by the sweep; an
    online key's session (proxy/conversations/online.py) this long after its last call."""
    sweep_interval_s: float = Field(5.0, gt=0.0)
    """Seconds between background sweeps for ended, expired or missed sessions."""
    call_drain_timeout_s: float = Field(900.0, gt=0.0)
    """Longest a session's finalization waits for its calls still generating or recording in the proxy
    (longer than `proxy.resume_timeout_s`, the longest a generation waits out weight pushes); a call
    still running after that is not in the session's trajectories, and a warning says so."""
    rest_and_hooks: Literal["rest_wins", "hooks_win", "sum"] = "rest_wins"
    """How a client's reward (REST, AReaL) and hook rewards on the same target (the session, or one
    completion) combine: "rest_wins" uses only the client's where it sent one, "hooks_win" only the hooks'
    where they gave one, "sum" adds both. Hook rewards among themselves add up weighted by each hook's
    `weight` (rewards/hooks/spec.py)."""
    train_retry_orphans: bool = False
    """Train on retry orphans too: completions of a call the client retried (same parent, same new
    messages) whose conversation went on from the retry's answer, never from theirs
    (rewards/orphans.py). They are marked `orphan_of` and counted either way; by default no trajectory
    holds them, since the agent never saw what they generated."""


class HookRunnerConfig(BaseModel):
    """How reward hook jobs are run (rewards/runner.py)."""

    model_config = ConfigDict(extra="forbid")

    in_proxy: bool = True
    """Run hooks inside the proxy process. False when `flywheel rewards` processes run them (several may
    share one Postgres database)."""
    concurrency: int = Field(8, ge=1, le=1024)
    """Jobs one runner runs at once."""
    workers: int = Field(1, ge=1, le=256)
    """Worker processes for CPU-bound graders (math-verify, user functions)."""
    worker_nice: int = Field(10, ge=0, le=19)
    """How much lower the worker processes' CPU priority is than the runner's (the proxy's, by default): on
    a busy machine graders yield the CPU to the process answering agents."""
    poll_interval_s: float = Field(0.5, gt=0.0)
    """How often an idle runner looks for due jobs."""
    timeout_s: float = Field(120.0, gt=0.0)
    """A hook's limit per run, unless its spec sets `timeout_s`."""
    max_attempts: int = Field(3, ge=1, le=100)
    """Runs before a job is marked failed, unless its spec sets `max_attempts`."""
    backoff_s: float = Field(2.0, ge=0.0)
    """Delay before the first retry; each further retry waits twice as long, at most `backoff_max_s`."""
    backoff_max_s: float = Field(300.0, ge=0.0)
    lease_margin_s: float = Field(60.0, gt=0.0)
    """A job's lease lasts its timeout plus this; a runner silent that long is presumed dead and its job
    is run again."""


MAX_FEEDBACK_VALUE = 1e6
"""The largest magnitude a feedback value (or a thumbs' configured value) may have: feedback is a rating,
and bounded values keep the sums it is added into finite."""


class FeedbackConfig(BaseModel):
    """How user feedback (`POST /rl/v1/feedback`, docs/online.md) becomes a reward."""

    model_config = ConfigDict(extra="forbid")

    thumbs_up: float = Field(1.0, allow_inf_nan=False, ge=-MAX_FEEDBACK_VALUE, le=MAX_FEEDBACK_VALUE)
    """The reward a thumbs up counts as."""
    thumbs_down: float = Field(-1.0, allow_inf_nan=False, ge=-MAX_FEEDBACK_VALUE, le=MAX_FEEDBACK_VALUE)
    """The reward a thumbs down counts as."""
    source: str = Field("feedback", min_length=1, max_length=64)
    """The source of the rewards feedback writes on its completion: per completion the latest value of
    each source counts, so a second feedback on one completion replaces the first. It may not start with
    `hook:` (reward hooks' sources)."""

    @field_validator("source")
    @classmethod
    def _not_a_hook_source(cls, source: str) -> str:
        if source.startswith(SOURCE_PREFIX):
            raise ValueError(f"the feedback source may not start with {SOURCE_PREFIX!r}: that is a hook's")
        return source


class RewardsConfig(BaseModel):
    """Reward hooks: which label which sessions, and how they run."""

    model_config = ConfigDict(extra="forbid")

    hooks: list[HookSpec] = Field(default_factory=list)
    """Hooks on every session created through the RL API or AReaL's routes that names none of its own."""
    group_hooks: list[HookSpec] = Field(default_factory=list)
    """Hooks on every group that names none of its own, run once all of its sessions have ended."""
    online_hooks: list[HookSpec] = Field(default_factory=list)
    """Hooks on the sessions an online key's conversations make."""
    runner: HookRunnerConfig = Field(default_factory=HookRunnerConfig)
    feedback: FeedbackConfig = Field(default_factory=FeedbackConfig)
    """What thumbs count as, and the source feedback rewards are written under."""


class EvalConfig(BaseModel):
    """The held-out evaluation that gates promotion (`trainer.promotion`, rewards/evaluation.py): each
    candidate version is loaded on a worker of its own and scored on this set with this hook."""

    model_config = ConfigDict(extra="forbid")

    dataset: str | None = None
    """A JSONL file, one item per line: `{"messages": [...]}` or `{"prompt": "..."}`, with an optional
    `id`, and what the hook compares against (`answer`, or `task` / `metadata` objects)."""
    hook: HookSpec | None = None
    """The session-level reward hook that scores each item's answer (e.g. `{"hook": "math"}`); its
    reward is the item's score."""
    worker_url: str | None = None
    """The eval worker's base URL; it must be none of the serving workers, since every candidate is
    loaded on it. `flywheel up --online` starts one and sets this."""
    max_new_tokens: int = Field(256, ge=1)
    """Answer length limit per item."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature; 0 is greedy, so that two versions are compared on their likeliest answers."""
    concurrency: int = Field(8, ge=1, le=1024)
    """Items generated at once."""
    limit: int | None = Field(None, ge=1)
    """Use only the first this many items."""
    timeout_s: float = Field(600.0, gt=0)
    """Longest one evaluation may take (generation and scoring)."""
