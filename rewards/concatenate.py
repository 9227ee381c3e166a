"""Pure "concatenated" trajectory building: each conversation chain of a session (root → leaf through
`parent_id`) becomes ONE training sample `p0 + o0 + p1 + o1 + … + pk + ok` (no I/O).

Conventions:
- Chains are the paths from a root to each leaf (a completion no other completion extends), ordered by
  the leaf's call order. Each completion's output is trained in exactly one trajectory: the first chain
  that contains it; in later chains (branches sharing that prefix) it is masked.
- `loss_mask` is True only on output tokens of trainable completions (rewards.finalize.is_trainable)
  trained in this chain; prompt suffixes (tool results, user turns, template tokens) are False.
  `logprobs` are the sampled logprobs on outputs and 0.0 elsewhere; `versions` are the policy versions
  of trained tokens and -1 on every masked token (so staleness counts only what is trained here).
- Reward of a chain: its return, the session reward plus every reward on a completion in the chain
  (shared-prefix rewards count in each chain that walks through them; the outputs they rewarded are
  still trained only once). `turn_discount` applies only to the "individual" style.
- A trajectory has one sampling temperature: a chain whose trained completions used different ones falls
  back to individual trajectories (one per trained completion, each with the chain's reward), warned.
- A chain with no trained token (all of it trained elsewhere, or untrainable) yields nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from rewards.finalize import SessionRewards, build_trajectory, full_prompts, is_trainable
from storage.records import CompletionRecord, TrajectoryRecord

logger = logging.getLogger(__name__)


def conversation_chains(completions: Sequence[CompletionRecord]) -> list[list[CompletionRecord]]:
    """Root-first chains ending at each leaf, in the leaves' call order (`completions` in call order;
    every parent must be among them)."""
    by_id = {c.id: c for c in completions}
    has_child = {c.parent_id for c in completions if c.parent_id is not None}
    chains = []
    for leaf in completions:
        if leaf.id in has_child:
            continue
        chain = [leaf]
        while (parent_id := chain[-1].parent_id) is not None:
            child = chain[-1]
            parent = by_id.get(parent_id)
            if parent is None:
                raise ValueError(f"completion {child.id}: parent {child.parent_id} is not in the session")
            if len(chain) > len(by_id):
                raise ValueError(f"completion {leaf.id}: its parent chain has a cycle")
            chain.append(parent)
        chains.append(chain[::-1])
    return chains


def chain_reward(chain: Sequence[CompletionRecord], rewards: SessionRewards) -> float:
    """The session reward plus the rewards on the chain's completions."""
    return (rewards.session or 0.0) + sum(rewards.completions.get(c.id, 0.0) for c in chain)


def concatenate_chain(
    chain: Sequence[CompletionRecord], trained: set[str], reward: float
) -> TrajectoryRecord:
    """One chain as one sample; outputs of completions in `trained` are trained, everything else masked."""
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    versions: list[np.ndarray] = []
    for completion in chain:
        prompt = np.asarray(completion.prompt_ids, dtype=np.int32)
        output = np.asarray(completion.output_ids, dtype=np.int32)
        train = completion.id in trained
        ids += [prompt, output]
        mask += [np.zeros(len(prompt), np.bool_), np.full(len(output), train, np.bool_)]
        logprobs += [np.zeros(len(prompt), np.float32), np.asarray(completion.output_logprobs, np.float32)]
        own_versions = np.asarray(completion.output_versions, np.int32)
        versions += [np.full(len(prompt), -1, np.int32),
                     own_versions if train else np.full(len(output), -1, np.int32)]
    temperatures = {c.temperature for c in chain if c.id in trained}
    return TrajectoryRecord(
        token_ids=np.concatenate(ids),  # (T,)
        loss_mask=np.concatenate(mask),
        logprobs=np.concatenate(logprobs),
        versions=np.concatenate(versions),
        reward=float(reward),
        temperature=float(temperatures.pop()) if temperatures else 1.0,
        completion_ids=tuple(c.id for c in chain if c.id in trained),
    )


def build_concatenated_trajectories(
    completions: Sequence[CompletionRecord], rewards: SessionRewards
) -> list[TrajectoryRecord]:
    """A session's trajectories, one per conversation chain (see the module docstring)."""
    assigned: set[str] = set()
    trajectories: list[TrajectoryRecord] = []
    prompts: dict[str, np.ndarray] | None = None
    for chain in conversation_chains(completions):
        trained = {c.id for c in chain if c.id not in assigned and is_trainable(c)}
        assigned.update(c.id for c in chain)
        if not trained:
            continue
        reward = chain_reward(chain, rewards)
        if not math.isfinite(reward):
            raise ValueError(f"trajectory reward overflows: {reward}")
        if len({c.temperature for c in chain if c.id in trained}) > 1:
            logger.warning("chain ending at %s mixes sampling temperatures; its completions are exported "
                           "one trajectory each", chain[-1].id)
            prompts = prompts if prompts is not None else full_prompts(completions)
            trajectories += [build_trajectory(prompts[c.id], c, reward) for c in chain if c.id in trained]
            continue
        trajectories.append(concatenate_chain(chain, trained, reward))
    return trajectories
