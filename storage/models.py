"""ORM models: the tables of docs/architecture.md, "Storage". Alembic migrations in migrations/ must match
them exactly."""

from __future__ import annotations

from datetime import UTC, date, datetime
from enum import StrEnum
from typing import Annotated, Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Date,
    DateTime,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    false,
    func,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from storage.packing import BoolArray, FloatArray, IntArray
from storage.types import BigIntKey, Float32Array, Int32Array, JsonType, MaskArray

# Deterministic constraint names, so migrations can drop and alter them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Both SQLite (REAL, stores ±inf) and Postgres (float8, stores NaN and ±inf) need this to stay finite.
_FINITE = "BETWEEN -1e308 AND 1e308"


def _utc_now() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """A stored time with its zone: SQLite hands back the UTC times it stores without it, Postgres with it."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


# Python-side default for microsecond order on SQLite; server default for rows written by hand.
Created = Annotated[datetime, mapped_column(default=_utc_now, server_default=func.now())]


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012 -- SQLAlchemy reads this class attribute
        datetime: DateTime(timezone=True),
        dict[str, Any]: JsonType,
        Any: JsonType,
        IntArray: Int32Array(),
        FloatArray: Float32Array(),
        BoolArray: MaskArray(),
    }


class SessionStatus(StrEnum):
    ACTIVE = "active"  # the agent may still call
    ENDED = "ended"  # no more calls; rewards may still arrive
    FINALIZED = "finalized"  # trajectories written; its group may be trained on


class JobState(StrEnum):
    QUEUED = "queued"  # waiting for a runner (at first, or after a failed attempt until `run_after`)
    RUNNING = "running"  # leased by a runner until `lease_until`
    DONE = "done"  # its rewards are written
    FAILED = "failed"  # gave up after `max_attempts`; `error` says why


class KeyScope(StrEnum):
    ADMIN = "admin"  # any route, any session
    SESSION = "session"  # one session's OpenAI calls, rewards and end
    ONLINE = "online"  # long-lived: its calls join the sessions it owns by conversation, or start new ones


class KeyHashScheme(StrEnum):
    """How an api_keys row's `key_hash` was computed from its key (storage/keys.py)."""

    LEGACY_SHA256 = "sha256"  # before keyed hashing; rewritten to HMAC_SHA256 when the key is next used
    HMAC_SHA256 = "hmac-sha256"  # HMAC-SHA256 with the server secret (`storage.key_secret`)


class ApiKey(Base):
    """A bearer key, stored only as a hex digest (`hash_scheme` says which), and its per-key limits."""

    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint(
            "(scope = 'admin' AND session_id IS NULL) OR (scope = 'session' AND session_id IS NOT NULL)"
            " OR (scope = 'online' AND session_id IS NULL)",
            name="scope_matches_session",
        ),
        CheckConstraint("hash_scheme IN ('sha256', 'hmac-sha256')", name="hash_scheme_known"),
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # New rows are keyed; the server default marks rows written by a process that predates the column.
    hash_scheme: Mapped[str] = mapped_column(
        String(16), default=KeyHashScheme.HMAC_SHA256.value, server_default=KeyHashScheme.LEGACY_SHA256.value
    )
    scope: Mapped[str] = mapped_column(String(16))
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"), index=True)
    created_at: Mapped[Created]
    revoked_at: Mapped[datetime | None]
    # Per-key limits (null: the proxy's defaults apply).
    requests_per_s: Mapped[float | None] = mapped_column(Double)
    burst: Mapped[int | None] = mapped_column(Integer)
    tokens_per_day: Mapped[int | None] = mapped_column(BigInteger)


class Group(Base):
    """Sessions attempting the same task; GRPO baselines are computed within it."""

    __tablename__ = "groups"
    __table_args__ = (CheckConstraint("size >= 1", name="size_positive"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int]
    task: Mapped[Any | None]
    reward_hooks: Mapped[Any | None]
    """The group hooks (a list of hook specs, rewards/hooks/spec.py) that label the group once every one of
    its sessions has ended; NULL: none."""
    created_at: Mapped[Created]


class Session(Base):
    """One episode: every call made with one session key."""

    __tablename__ = "sessions"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'ended', 'finalized')", name="status_known"),
        CheckConstraint(
            "(status = 'active' AND ended_at IS NULL) OR (status <> 'active' AND ended_at IS NOT NULL)",
            name="ended_at_matches_status",
        ),
        Index("ix_sessions_owner_conversation", "owner_key_hash", "conversation"),
        Index("ix_sessions_created_at_id", "created_at", "id"),  # the dashboard's table, newest first
        # Admission control counts the sessions holding a slot (storage/admission.py): only those.
        Index(
            "ix_sessions_holds_slot",
            "holds_slot",
            sqlite_where=text("holds_slot = 1"),
            postgresql_where=text("holds_slot"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    group_id: Mapped[str | None] = mapped_column(ForeignKey("groups.id"), index=True)
    task: Mapped[Any | None]
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", default=dict)
    owner_key_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    """The online key whose calls made this session (they join it while it is active), if any."""
    reward_hooks: Mapped[Any | None]
    """The hooks (a list of hook specs, rewards/hooks/spec.py) that label the session once it has ended,
    fixed when it was created; NULL: none."""
    conversation: Mapped[str | None] = mapped_column(String(128))
    """The conversation hint the owning online key's calls carried (`X-Flywheel-Conversation`); NULL:
    none, the calls were grouped by their messages alone."""
    status: Mapped[str] = mapped_column(
        String(16), default=SessionStatus.ACTIVE.value, server_default=SessionStatus.ACTIVE.value
    )
    holds_slot: Mapped[bool] = mapped_column(server_default=false())
    """Holds an RL API admission slot (docs/architecture.md, "Admission control"): opened through the RL
    API and not known untrainable (finalized without trajectories, or all of them dropped)."""
    created_at: Mapped[Created]
    ended_at: Mapped[datetime | None]


class Completion(Base):
    """One LLM call. With a parent it holds only the suffix: its prompt_ids are the tokens of the new
    messages that follow the parent's prompt + output, and request_json holds only the new messages."""

    __tablename__ = "completions"
    __table_args__ = (
        CheckConstraint(
            "length(output_ids) = length(output_logprobs) AND length(output_ids) = length(output_versions)",
            name="output_lengths_match",
        ),
        Index("ix_completions_session_id_created_at", "session_id", "created_at"),
        Index("ix_completions_created_at", "created_at"),  # the dashboard's throughput windows
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("completions.id"), index=True)
    prompt_ids: Mapped[IntArray]
    output_ids: Mapped[IntArray]
    output_logprobs: Mapped[FloatArray]
    output_versions: Mapped[IntArray]
    finish_reason: Mapped[str] = mapped_column(String(32))
    temperature: Mapped[float] = mapped_column(Double)
    top_p: Mapped[float] = mapped_column(Double)
    top_k: Mapped[int] = mapped_column(Integer)  # -1: no top-k truncation (SGLang's convention)
    branched: Mapped[bool] = mapped_column(default=False, server_default=false())
    orphan_of: Mapped[str | None] = mapped_column(String(64))
    """A retry orphan: a call the client retried, whose conversation continued from this completion
    instead (same parent, same new messages); NULL: not an orphan."""
    dropped_messages: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    """Trailing messages of the parent's request this call left out and still extended it (ephemeral
    context the agent re-sends fresh each time: docs/architecture.md, "The token-exact rule")."""
    request_json: Mapped[dict[str, Any]]
    response_json: Mapped[dict[str, Any]]
    created_at: Mapped[Created]


class Reward(Base):
    """A float attached to exactly one of a session or a completion."""

    __tablename__ = "rewards"
    __table_args__ = (
        CheckConstraint(
            "(session_id IS NULL AND completion_id IS NOT NULL)"
            " OR (session_id IS NOT NULL AND completion_id IS NULL)",
            name="one_target",
        ),
        CheckConstraint(f"value {_FINITE}", name="value_finite"),
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"), index=True)
    completion_id: Mapped[str | None] = mapped_column(ForeignKey("completions.id"), index=True)
    value: Mapped[float] = mapped_column(Double)
    source: Mapped[str] = mapped_column(String(64))
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[Created]


class Trajectory(Base):
    """A training sample built from a session's completions; claimed, then consumed by one train step."""

    __tablename__ = "trajectories"
    __table_args__ = (
        CheckConstraint(
            "length(token_ids) = length(logprobs) AND length(token_ids) = length(versions)"
            " AND length(token_ids) = 4 * length(loss_mask)",
            name="lengths_match",
        ),
        CheckConstraint(f"reward {_FINITE}", name="reward_finite"),
        CheckConstraint(
            "(claim_token IS NULL AND claimed_at IS NULL)"
            " OR (claim_token IS NOT NULL AND claimed_at IS NOT NULL)",
            name="claim_complete",
        ),
        # The claim query reads unconsumed rows that are fresh enough: a range on min_version skips
        # the stale rows that are never claimed, and consumed and dropped rows leave this index.
        Index(
            "ix_trajectories_unconsumed",
            "min_version",
            "id",
            sqlite_where=text("consumed_step IS NULL AND dropped_at IS NULL"),
            postgresql_where=text("consumed_step IS NULL AND dropped_at IS NULL"),
        ),
        Index("ix_trajectories_created_at", "created_at"),  # the dashboard's throughput windows
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    group_id: Mapped[str | None] = mapped_column(ForeignKey("groups.id"), index=True)
    token_ids: Mapped[IntArray]
    loss_mask: Mapped[BoolArray]
    logprobs: Mapped[FloatArray]
    versions: Mapped[IntArray]  # per token; -1 for tokens the policy did not generate
    reward: Mapped[float] = mapped_column(Double)
    # Sampling temperature of the generated tokens: the trainer's logprobs must use the same one.
    temperature: Mapped[float] = mapped_column(Double, server_default=text("1.0"))
    min_version: Mapped[int]  # oldest behaviour version among generated tokens
    completion_ids: Mapped[Any | None]
    """The completions whose generated tokens the sample trains (late feedback on one of them reaches
    it); NULL on samples written before this was recorded."""
    baseline_key: Mapped[str | None] = mapped_column(String(64))
    """Whose running reward baseline an ungrouped sample is measured against (its task, else its
    online key); NULL: the batch's."""
    created_at: Mapped[Created]
    claimed_at: Mapped[datetime | None]
    claim_token: Mapped[str | None] = mapped_column(String(36), index=True)
    consumed_step: Mapped[int | None] = mapped_column(ForeignKey("train_steps.step"), index=True)
    dropped_at: Mapped[datetime | None]
    """When a claim found it (or a member of its group) older than η and dropped it: never trained,
    no longer considered (storage/claims.py); NULL: not dropped."""


class VersionStatus(StrEnum):
    CANDIDATE = "candidate"  # trained, not served yet: being evaluated (or never gated)
    PROMOTED = "promoted"  # passed its evaluation (or was pushed without one) and may be served
    REJECTED = "rejected"  # failed its evaluation: never served


class PolicyVersion(Base):
    """A policy the trainer produced, one per step. Without promotion gating every version is pushed and
    recorded promoted; with it, a version is a candidate until its evaluation promotes or rejects it."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    checkpoint_path: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(
        String(16), default=VersionStatus.PROMOTED.value, server_default=VersionStatus.PROMOTED.value
    )
    parent_version: Mapped[int | None] = mapped_column(Integer)
    """The version it was trained from (NULL for version 0 and rows from before gating)."""
    eval_score: Mapped[float | None] = mapped_column(Double)
    """Mean reward on the eval set; NULL: not evaluated."""
    eval_details: Mapped[dict[str, Any] | None]
    """The evaluation: per-item scores, item count, the eval worker, timings."""
    reason: Mapped[str | None] = mapped_column(Text)
    """Why it was promoted or rejected, in words."""
    served_at: Mapped[datetime | None]
    """When the serving workers last started serving it; the newest one is the version being served."""
    created_at: Mapped[Created]


class TrainStep(Base):
    """One optimiser step and the policy version it produced."""

    __tablename__ = "train_steps"

    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    policy_version: Mapped[int] = mapped_column(ForeignKey("policy_versions.version"), index=True)
    metrics: Mapped[dict[str, Any]]
    created_at: Mapped[Created]


class KeyUsage(Base):
    """Tokens (prompt + completion) served to one API key on one UTC day: what daily quotas count."""

    __tablename__ = "key_usage"
    __table_args__ = (CheckConstraint("tokens >= 0", name="tokens_not_negative"),)

    key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id"), primary_key=True)
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    tokens: Mapped[int] = mapped_column(BigInteger)


class FeedbackState(StrEnum):
    APPLIED = "applied"  # joined training: written as a reward before its trajectory was consumed
    LATE = "late"  # arrived after its trajectory was consumed (or claimed): stored and counted only


class Feedback(Base):
    """One user judgement of one completion (`POST /rl/v1/feedback`): a value or a thumbs, and an
    optional comment."""

    __tablename__ = "feedback"
    __table_args__ = (
        CheckConstraint("state IN ('applied', 'late')", name="state_known"),
        CheckConstraint("thumbs IS NULL OR thumbs IN ('up', 'down')", name="thumbs_known"),
        CheckConstraint(f"value {_FINITE}", name="value_finite"),
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    completion_id: Mapped[str] = mapped_column(ForeignKey("completions.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    """The key that gave it."""
    value: Mapped[float | None] = mapped_column(Double)
    thumbs: Mapped[str | None] = mapped_column(String(4))
    comment: Mapped[str | None] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    reward_id: Mapped[int | None] = mapped_column(ForeignKey("rewards.id"))
    """The reward it wrote, when it was applied with a value."""
    created_at: Mapped[Created]


class RewardJob(Base):
    """One reward hook to run on one ended session, or on one group whose sessions have all ended. Written
    in the transaction that ends the session; claimed by hook runners with a lease (rewards/runner.py)."""

    __tablename__ = "reward_jobs"
    __table_args__ = (
        CheckConstraint(
            "(session_id IS NULL AND group_id IS NOT NULL) OR (session_id IS NOT NULL AND group_id IS NULL)",
            name="one_subject",
        ),
        CheckConstraint("state IN ('queued', 'running', 'done', 'failed')", name="state_known"),
        Index("ux_reward_jobs_session_source", "session_id", "source", unique=True),
        Index("ux_reward_jobs_group_source", "group_id", "source", unique=True),
        Index("ix_reward_jobs_state_run_after", "state", "run_after"),
        Index("ix_reward_jobs_finished_at", "finished_at"),  # the dashboard's throughput windows
    )

    id: Mapped[int] = mapped_column(BigIntKey, primary_key=True)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"))
    group_id: Mapped[str | None] = mapped_column(ForeignKey("groups.id"))
    source: Mapped[str] = mapped_column(String(64))
    """The source its rewards are written under: "hook:<name>"."""
    spec: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16), default=JobState.QUEUED.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    """Runs started (a claim counts one, so a runner killed mid-run still uses up an attempt)."""
    max_attempts: Mapped[int] = mapped_column(Integer)
    run_after: Mapped[datetime]
    lease_token: Mapped[str | None] = mapped_column(String(36))
    lease_until: Mapped[datetime | None]
    error: Mapped[str | None] = mapped_column(Text)
    """The last attempt's error, when it failed."""
    result: Mapped[dict[str, Any] | None]
    """What the job wrote: the rewards, or that the hook had no opinion."""
    created_at: Mapped[Created]
    finished_at: Mapped[datetime | None]
