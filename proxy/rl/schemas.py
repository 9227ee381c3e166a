"""Request and response bodies of the RL control API (/rl/v1/…) and of AReaL's compatible routes (/rl/…)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rewards.config import MAX_FEEDBACK_VALUE
from rewards.hooks.spec import HookSpec

MAX_GROUP_SIZE = 1024
"""Most sessions one group may hold: a GRPO group is a handful to a few hundred attempts."""

RewardValue = Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-1e308, le=1e308)]
"""A finite JSON number (no strings, no booleans; NaN/Infinity literals are refused); the bound is the
database's: larger magnitudes do not fit a finite float8 check on every backend."""

Identifier = Annotated[str, Field(min_length=1, max_length=64)]

MAX_COMMENT_CHARS = 16384
"""Longest feedback comment, in characters: a user's remark on one answer, not a document."""

HookSpecs = HookSpec | Annotated[list[HookSpec], Field(max_length=16)] | None
"""Reward hooks named at creation: one spec or a list (rewards/hooks/spec.py)."""


class _Strict(BaseModel):
    """Our own API refuses unknown fields, so a misspelt `valeu` is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid")


class CreateSessionRequest(_Strict):
    task: Any = None
    """Anything JSON that describes the task (a prompt, a dataset row id)."""
    group_id: Identifier | None = None
    """Join this group (made by POST /rl/v1/groups with room left); 409 when it is full."""
    metadata: dict[str, Any] = Field(default_factory=dict)
    reward: HookSpecs = None
    """The reward hooks that label the session once it ends, e.g. `{"hook": "math"}` (the reference answer
    in `metadata` or `task`: `{"answer": "42"}`); null: the configured `rewards.hooks`; []: none."""



class CreateSessionResponse(BaseModel):
    session_id: str
    api_key: str
    """The session key: shown only here, stored only as its hash."""
    base_url: str
    """The OpenAI base URL the agent uses with `api_key`."""


class CreateGroupRequest(_Strict):
    size: Annotated[int, Field(strict=True, ge=1, le=MAX_GROUP_SIZE)]
    task: Any = None
    reward: HookSpecs = None
    """The reward hooks of each of its sessions; null: the configured `rewards.hooks`; []: none."""
    group_reward: HookSpecs = None
    """The hooks that label the group as a whole once all its sessions have ended (a judge ranking its
    members); null: the configured `rewards.group_hooks`; []: none."""


class GroupSession(BaseModel):
    session_id: str
    api_key: str


class CreateGroupResponse(BaseModel):
    group_id: str
    sessions: list[GroupSession]
    base_url: str


class RewardRequest(_Strict):
    value: RewardValue
    source: Annotated[str, Field(min_length=1, max_length=64)] = "rest"
    """Who judged: rewards of one target combine per source (the latest of each source, summed)."""
    details: dict[str, Any] = Field(default_factory=dict)


class RewardResponse(BaseModel):
    reward_id: int
    session_id: str
    completion_id: str | None
    value: float
    source: str


class EndSessionResponse(BaseModel):
    session_id: str
    status: str
    ended: bool
    """False when the session had ended already (ending is idempotent)."""


class CompletionSummary(BaseModel):
    id: str
    parent_id: str | None
    finish_reason: str
    prompt_tokens: int
    """Full prompt length, including the tokens inherited from the parent chain."""
    completion_tokens: int
    versions: list[int]
    """The distinct policy versions that generated its output tokens, ascending."""
    temperature: float
    orphan_of: str | None = None
    """A retry orphan (set at finalization): the completion its conversation went on from instead."""


class RewardSummary(BaseModel):
    id: int
    value: float
    source: str
    completion_id: str | None
    details: dict[str, Any]
    created_at: str


class HookJobView(BaseModel):
    """One reward hook's job on a session (or on its group)."""

    level: str
    """"session", or "group" for a hook labelling the session's whole group."""
    source: str
    """The source of the rewards it writes: "hook:<name>"."""
    state: str
    """"queued", "running", "done" (its rewards, if any, are in `rewards`) or "failed" (see `error`)."""
    attempts: int
    max_attempts: int
    error: str | None
    result: dict[str, Any] | None
    created_at: str
    finished_at: str | None


class FeedbackRequest(_Strict):
    """`POST /rl/v1/feedback`: a user's judgement of one completion; at least one of `value`, `thumbs`
    and `comment`, and not both a value and a thumbs."""

    completion_id: Identifier | None = None
    """The `id` of a chat completion (`chatcmpl-…`), a Responses object (`resp_…`) or a legacy completion
    (`cmpl-…`), or a choice's `completion_id` (n > 1); None: the caller's latest completion (an online
    key's newest in the sessions it owns, a session key's in its session; an admin key must name one)."""
    value: Annotated[float, Field(strict=True, allow_inf_nan=False, ge=-MAX_FEEDBACK_VALUE,
                                  le=MAX_FEEDBACK_VALUE)] | None = None
    """The reward it gives the completion."""
    thumbs: Literal["up", "down"] | None = None
    """A thumbs up or down, worth `rewards.feedback.thumbs_up` / `thumbs_down`."""
    comment: Annotated[str, Field(min_length=1, max_length=MAX_COMMENT_CHARS)] | None = None
    """What the user said: stored, and read by reward hooks (the `feedback` hook may have it judged); it
    writes no reward by itself."""

    @model_validator(mode="after")
    def _one_judgement(self) -> Self:
        if self.value is None and self.thumbs is None and self.comment is None:
            raise ValueError("give at least one of value, thumbs and comment")
        if self.value is not None and self.thumbs is not None:
            raise ValueError("give a value or a thumbs, not both")
        return self


class FeedbackResponse(BaseModel):
    feedback_id: int
    completion_id: str
    session_id: str
    state: str
    """"applied": it reaches training (as a reward on the completion, or added to the rewards of its
    finalized trajectories not yet claimed); "late": stored only, its trajectories were claimed or
    consumed already (or none trains the completion)."""
    reward_id: int | None = None
    """The reward it wrote (none for a comment alone, or a late feedback)."""


class FeedbackSummary(BaseModel):
    """One feedback as `GET /rl/v1/sessions/{id}` shows it (like the session's completions, without the
    user's text: its comment is for reward hooks)."""

    id: int
    completion_id: str
    value: float | None
    """What it counted as (a thumbs' configured value); None for a comment alone."""
    thumbs: str | None
    state: str
    created_at: str


class SessionView(BaseModel):
    session_id: str
    status: str
    """"active", "ended" (rewards may still arrive) or "finalized" (trajectories written)."""
    group_id: str | None
    task: Any
    metadata: dict[str, Any]
    created_at: str
    ended_at: str | None
    completions: list[CompletionSummary]
    rewards: list[RewardSummary]
    hooks: list[HookJobView]
    """The session's reward hook jobs (queued when it ended) and its group's."""
    feedback: list[FeedbackSummary] = Field(default_factory=list)
    """Its users' feedback (`POST /rl/v1/feedback`), oldest first."""


# AReaL's proxy API (areal/experimental/openai/proxy): extra fields are ignored, as AReaL does.


class ArealStartSessionRequest(BaseModel):
    task_id: Any = None
    api_key: str | None = None
    """Reuse this key: a session still active on it is ended and finalized, and the key moves to the
    new session."""
    group_size: Annotated[int, Field(strict=True, ge=1, le=MAX_GROUP_SIZE)] | None = None
    """AReaL v2: start a whole group; the answer is 201 with its sessions."""


class ArealStartSessionResponse(BaseModel):
    session_id: str
    api_key: str


class ArealGroupSession(BaseModel):
    session_id: str
    session_api_key: str


class ArealStartGroupResponse(BaseModel):
    group_id: str
    sessions: list[ArealGroupSession]


class ArealSetRewardRequest(BaseModel):
    reward: RewardValue
    interaction_id: Identifier | None = None
    """A completion id (chatcmpl-…) of the caller's session; None: its last completion."""


class ArealMessageResponse(BaseModel):
    message: str


class ArealEndSessionResponse(BaseModel):
    message: str
    interaction_count: int


class VersionSummary(BaseModel):
    """One policy version: its promotion status, evaluation and lineage."""

    version: int
    status: Literal["candidate", "promoted", "rejected"]
    parent_version: int | None
    """The version it was trained from."""
    eval_score: float | None
    """Its mean score on the eval set; null when it was not evaluated (promotion not gated)."""
    reason: str | None
    """Why it was promoted or rejected."""
    served_at: str | None
    """When the serving workers last started serving it."""
    created_at: str


class PolicyView(BaseModel):
    """`GET /rl/v1/policy`: the version being served (what new completions carry; 0, the initial
    weights, before any) and the newest one trained, which with gated promotion may still be a candidate
    or have been rejected."""

    policy_version: int
    """The served version."""
    served: VersionSummary | None
    newest: VersionSummary | None
    """The newest version trained, whatever its status."""
    best_version: int | None
    """The promoted version with the best eval score (the newest promoted one without scores)."""


class KeyView(BaseModel):
    """A stored API key as `GET /rl/v1/keys` and its revoke route show it: never the key or its hash."""

    id: int
    kind: str
    """"admin", "online" or "session"."""
    created_at: str
    revoked_at: str | None
    session_id: str | None
    """The session of a session key."""


class KeyList(BaseModel):
    """`GET /rl/v1/keys`: keys, newest first."""

    object: str = "list"
    data: list[KeyView]
    has_more: bool
    """More keys match than `limit` returned."""
