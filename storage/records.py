"""Narrow records passed between stages: proxy → storage, finalizer → storage, storage → trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from storage.packing import BoolArray, FloatArray, FloatsLike, IntArray, IntsLike, MaskLike

# Records holding arrays compare by identity (eq=False): `==` on numpy arrays is elementwise.


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupRecord:
    """A group as the proxy creates it; its sessions join it (up to `size`) as they are created."""

    id: str
    size: int
    task: Any = None
    reward_hooks: list[dict[str, Any]] | None = None  # hook specs run once all its sessions have ended


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRecord:
    """A new session and the keyed hash of its session key (storage/keys.py: `KeyHasher`)."""

    id: str
    key_hash: str
    group_id: str | None = None
    task: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    owner_key_hash: str | None = None  # the online key whose calls made it (storage.models.Session)
    reward_hooks: list[dict[str, Any]] | None = None  # hook specs run when it ends (rewards/hooks/spec.py)
    conversation: str | None = None  # its online key's conversation hint (X-Flywheel-Conversation), if any
    admitted: bool = False  # opened through the RL API: it holds an admission slot (storage/admission.py)


@dataclass(frozen=True, slots=True, kw_only=True)
class ApiKeyRecord:
    """What a valid bearer key may do: `scope` "admin" (anything) or "session" (only `session_id`)."""

    scope: str
    session_id: str | None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CompletionRecord:
    """One LLM call as the proxy records it. With `parent_id`, `prompt_ids` holds only the suffix after
    the parent's prompt + output tokens, and `request_json` only the new messages (docs/architecture.md,
    "Storage")."""

    id: str  # chatcmpl-… (chat) or cmpl-…-<index> (completions)
    session_id: str
    parent_id: str | None
    prompt_ids: IntsLike
    output_ids: IntsLike
    output_logprobs: FloatsLike  # of the sampling distribution at `temperature`
    output_versions: IntsLike  # policy version that generated each output token
    finish_reason: str
    temperature: float
    top_p: float
    top_k: int  # -1: no top-k truncation
    request_json: dict[str, Any]
    response_json: dict[str, Any]
    branched: bool = False  # the client changed history, so this starts a new branch
    orphan_of: str | None = None  # a retry orphan: the completion its conversation continued from instead
    dropped_messages: int = 0  # trailing messages of the parent's request this call left out (ephemeral)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TrajectoryRecord:
    """One training sample as the session finalizer writes it."""

    token_ids: IntsLike
    loss_mask: MaskLike  # True where the policy generated the token and it is trained on
    logprobs: FloatsLike  # behaviour logprobs; any value where the mask is False
    versions: IntsLike  # per token; -1 for tokens the policy did not generate
    reward: float
    temperature: float = 1.0  # the generated tokens' sampling temperature
    completion_ids: tuple[str, ...] = ()  # the completions whose generated tokens it trains


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class TrainingSample:
    """The trainer contract: one claimed trajectory."""

    trajectory_id: int
    token_ids: IntArray  # (T,)
    loss_mask: BoolArray  # (T,)
    logprobs: FloatArray  # (T,) behaviour logprobs
    versions: IntArray  # (T,) -1 for prompt and tool tokens
    reward: float
    group_id: str | None  # None: a singleton, normalised with batch baselines
    temperature: float = 1.0  # compute the trainer's logprobs at this sampling temperature
    baseline_key: str | None = None  # a singleton's running-baseline key (its task or key); None: batch

    @property
    def min_version(self) -> int:
        """Oldest behaviour version among generated tokens."""
        generated = self.versions[self.versions >= 0]
        return int(generated.min())


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ClaimedBatch:
    """Trajectories held by one claim until `record_step` consumes them or `release_claim` frees them.
    Whole groups only: every trajectory of each group in it is present."""

    claim_token: str
    samples: tuple[TrainingSample, ...]
    dropped: int = 0  # samples this claim found older than η (or in such a group) and dropped

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(sample.trajectory_id for sample in self.samples)

    def __len__(self) -> int:
        return len(self.samples)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One optimiser step: the policy version it produced and where that checkpoint lives."""

    step: int
    policy_version: int
    checkpoint_path: str
    metrics: dict[str, float] = field(default_factory=dict)
    parent_version: int | None = None  # the version it was trained from
    candidate: bool = False  # gated: recorded as a candidate, served only once its evaluation promotes it


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalResult:
    """A policy version's score on the eval set: the mean of its items' scores, and each item's score
    (by item id) so that two versions can be compared item by item."""

    score: float
    item_scores: dict[str, float]
    details: dict[str, Any] = field(default_factory=dict)  # the eval worker, timings, sample outputs
