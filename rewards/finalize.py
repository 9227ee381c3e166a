"""Pure trajectory building: a session's completions and rewards become training samples (no I/O).

Conventions ("individual" style, one trajectory per trainable completion):
- A completion is trainable unless its finish reason is "abort" (generation cut off by an abort or a
  pause: a partial answer the agent never saw whole), it has no output tokens (nothing to train on), or
  an output token has a negative (unknown) policy version.
- Rewards on one target (the session, or one completion) combine as: per source, the latest value wins
  (a client re-posting a reward corrects it); a client's sources add up, reward hooks' sources (`hook:…`)
  add up (each already weighted by its hook's weight), and the two sides combine by the finalizer's
  `rest_and_hooks` rule: by default a client's reward wins where there is one.
- Per-turn reward `r_i` of the i-th trainable completion in call order is its own combined reward (0 if
  none); the session reward is added to the last trainable completion's `r`. A reward on a completion
  that is not trainable is ignored (the finalizer logs it).
- Trajectory reward `R_i = r_i + γ·R_{i+1}`, walking back from the last trainable completion (AReaL's
  convention), so with γ = 1 every turn gets the session reward plus all rewards from itself onward.
- Sequences: `token_ids = full prompt + output`; the full prompt of a completion with a parent is rebuilt
  from the chain (`parent prompt + parent output + own suffix`; docs/architecture.md, "The token-exact
  rule"). `loss_mask` is False on the prompt and True on the output; `logprobs` 0.0 on the prompt and the
  sampled logprobs on the output; `versions` -1 on the prompt and each output token's policy version;
  `temperature` the completion's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rewards.hooks.spec import SOURCE_PREFIX
from storage.packing import IntArray
from storage.records import CompletionRecord, TrajectoryRecord

ABORT_FINISH_REASON = "abort"

RestAndHooks = Literal["rest_wins", "hooks_win", "sum"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardEntry:
    """One stored reward, in arrival order; `completion_id` None means a session reward."""

    value: float
    source: str
    completion_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRewards:
    """A session's rewards, combined per target: `session` None when no session reward arrived."""

    session: float | None
    completions: Mapping[str, float]

    @property
    def empty(self) -> bool:
        """No reward of any kind: the finalizer's `missing_reward` policy applies."""
        return self.session is None and not self.completions


def combine_rewards(
    entries: Sequence[RewardEntry], rest_and_hooks: RestAndHooks = "rest_wins"
) -> SessionRewards:
    """Per target: the latest value of each source; a client's sources summed, hooks' sources summed (their
    values are weighted already), and the two combined by `rest_and_hooks` (`entries` in arrival order)."""
    latest: dict[tuple[str | None, str], float] = {}
    for entry in entries:
        latest[(entry.completion_id, entry.source)] = float(entry.value)
    client: dict[str | None, float] = {}
    hooks: dict[str | None, float] = {}
    for (target, source), value in latest.items():
        side = hooks if source.startswith(SOURCE_PREFIX) else client
        side[target] = side.get(target, 0.0) + value
    combined: dict[str | None, float] = {}
    for target in client.keys() | hooks.keys():
        combined[target] = _combine(client.get(target), hooks.get(target), rest_and_hooks)
    session = combined.pop(None, None)
    return SessionRewards(session=session, completions={k: v for k, v in combined.items() if k is not None})


def _combine(client: float | None, hooks: float | None, rule: RestAndHooks) -> float:
    if client is None or hooks is None:
        value = client if hooks is None else hooks
        assert value is not None
        return value
    if rule == "rest_wins":
        return client
    if rule == "hooks_win":
        return hooks
    return client + hooks


def is_trainable(completion: CompletionRecord) -> bool:
    """False for aborted generations, completions without output tokens, and outputs with a token of
    unknown policy version (< 0: staleness cannot be bounded for it)."""
    versions = np.asarray(completion.output_versions)
    return (
        completion.finish_reason != ABORT_FINISH_REASON
        and len(completion.output_ids) > 0
        and bool((versions >= 0).all())
    )


def is_ready(rewards: SessionRewards, trainable_ids: Sequence[str]) -> bool:
    """Whether an ended session has its reward: a session reward, or a reward on every trainable
    completion (then later completion rewards cannot be missing)."""
    if rewards.session is not None:
        return True
    return bool(trainable_ids) and all(cid in rewards.completions for cid in trainable_ids)


def full_prompts(completions: Sequence[CompletionRecord]) -> dict[str, IntArray]:
    """The full prompt of each completion, rebuilt through its parents, which must all be in
    `completions` (a session's completions: a parent always belongs to its child's session)."""
    by_id = {c.id: c for c in completions}
    prompts: dict[str, IntArray] = {}
    for completion in completions:
        pending: list[CompletionRecord] = []
        node = completion
        while node.id not in prompts:
            pending.append(node)
            if node.parent_id is None:
                break
            if len(pending) > len(by_id):
                raise ValueError(f"completion {completion.id}: its parent chain has a cycle")
            parent = by_id.get(node.parent_id)
            if parent is None:
                raise ValueError(f"completion {node.id}: parent {node.parent_id} is not in the session")
            node = parent
        for item in reversed(pending):  # root (or the first known ancestor's child) first
            suffix = np.asarray(item.prompt_ids, dtype=np.int32)
            if item.parent_id is None:
                prompts[item.id] = suffix
                continue
            parent = by_id[item.parent_id]
            parent_output = np.asarray(parent.output_ids, dtype=np.int32)
            prompts[item.id] = np.concatenate([prompts[parent.id], parent_output, suffix])
    return prompts


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """`R_i = r_i + gamma * R_{i+1}`, walking back from the last turn."""
    returns = [0.0] * len(rewards)
    running = 0.0
    for i in range(len(rewards) - 1, -1, -1):
        running = rewards[i] + gamma * running
        returns[i] = running
    return returns


def turn_rewards(completion_ids: Sequence[str], rewards: SessionRewards) -> list[float]:
    """`r_i` of each trainable completion in call order: its own reward, plus the session reward on the
    last one. Rewards on ids not listed are ignored."""
    per_turn = [rewards.completions.get(cid, 0.0) for cid in completion_ids]
    if per_turn and rewards.session is not None:
        per_turn[-1] += rewards.session
    return per_turn


def build_trajectory(prompt_ids: IntArray, completion: CompletionRecord, reward: float) -> TrajectoryRecord:
    """One completion as a training sample: the prompt masked out, the output trained on."""
    output_ids = np.asarray(completion.output_ids, dtype=np.int32)
    output_logprobs = np.asarray(completion.output_logprobs, dtype=np.float32)
    output_versions = np.asarray(completion.output_versions, dtype=np.int32)
    if not len(output_ids) == len(output_logprobs) == len(output_versions):
        raise ValueError(f"completion {completion.id}: output ids, logprobs and versions differ in length")
    n_prompt, n_output = len(prompt_ids), len(output_ids)
    return TrajectoryRecord(
        token_ids=np.concatenate([np.asarray(prompt_ids, dtype=np.int32), output_ids]),  # (P+O,)
        loss_mask=np.concatenate([np.zeros(n_prompt, dtype=np.bool_), np.ones(n_output, dtype=np.bool_)]),
        logprobs=np.concatenate([np.zeros(n_prompt, dtype=np.float32), output_logprobs]),
        versions=np.concatenate([np.full(n_prompt, -1, dtype=np.int32), output_versions]),
        reward=float(reward),
        temperature=float(completion.temperature),
        completion_ids=(completion.id,),
    )


def build_session_trajectories(
    completions: Sequence[CompletionRecord], rewards: SessionRewards, turn_discount: float
) -> list[TrajectoryRecord]:
    """A session's trajectories, one per trainable completion, in call order (`completions` in call
    order). A session without any reward gets reward 0 on every turn: the caller decides whether that
    is wanted (FinalizerConfig.missing_reward)."""
    prompts = full_prompts(completions)
    trainable = [c for c in completions if is_trainable(c)]
    returns = discounted_returns(turn_rewards([c.id for c in trainable], rewards), turn_discount)
    if not all(math.isfinite(r) for r in returns):
        raise ValueError(f"trajectory rewards overflow: {returns}")
    return [build_trajectory(prompts[c.id], c, r) for c, r in zip(trainable, returns, strict=True)]
