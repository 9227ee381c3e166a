"""Rollouts for trainer tests: sample a group from a worker with real logprobs and versions, score it,
and write it as one finalized session per sample (what the proxy and finalizer do, without them)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.client import SGLangClient
from storage.engine import SessionFactory
from storage.queries import create_group, insert_trajectories
from storage.records import GroupRecord, SessionRecord, TrajectoryRecord
from tests.support.databases import key_hash

RewardFn = Callable[[Sequence[int]], float]
_ids = itertools.count()
_SAMPLE_ATTEMPTS = 5


def policy_version(label: str) -> int:
    """SGLang's weight_version string as a policy version ("default" is the initial weights, 0)."""
    return 0 if label == "default" else int(label)


def token_versions(meta: dict[str, Any], num_tokens: int) -> list[int]:
    """The version of each output token: one for all, or per span when weights changed mid-request."""
    versions = [policy_version(meta["weight_version"])] * num_tokens
    for span in meta.get("weight_versions") or ():
        versions[span["start"] : span["end"]] = [policy_version(span["version"])] * (
            span["end"] - span["start"]
        )
    return versions


@dataclass(frozen=True)
class Rollout:
    group_id: str
    outputs: list[list[int]]
    rewards: list[float]
    min_version: int


async def rollout_group(
    client: SGLangClient,
    session_factory: SessionFactory,
    prompt_ids: Sequence[int],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    reward_fn: RewardFn,
    seed: int,
) -> Rollout:
    """Sample `group_size` completions of `prompt_ids` in one request and store them as one group."""
    request = {
        "input_ids": list(prompt_ids),
        "return_logprob": True,
        "sampling_params": {
            "n": group_size,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "sampling_seed": seed,
        },
    }
    for _ in range(_SAMPLE_ATTEMPTS):
        answer = await client.generate(request)
        samples = answer if isinstance(answer, list) else [answer]
        # A weight push (pause in abort mode) can end a sample before its first token, which leaves
        # nothing to train on: the group is sampled again, as the proxy would resume it.
        if all(sample["output_ids"] for sample in samples):
            break
    else:
        raise RuntimeError(f"{_SAMPLE_ATTEMPTS} samplings of a group each had a sample with no tokens")
    group_id = f"group-{next(_ids)}"
    sessions = [
        SessionRecord(id=f"{group_id}-s{i}", key_hash=key_hash(f"{group_id}-s{i}"), group_id=group_id)
        for i in range(group_size)
    ]
    await create_group(session_factory, GroupRecord(id=group_id, size=group_size), sessions)
    outputs, rewards, oldest = [], [], []
    for session, sample in zip(sessions, samples, strict=True):
        output = [int(t) for t in sample["output_ids"]]
        logprobs = [float(entry[0]) for entry in sample["meta_info"]["output_token_logprobs"]]
        versions = token_versions(sample["meta_info"], len(output))
        reward = reward_fn(output)
        prompt_len = len(prompt_ids)
        await insert_trajectories(
            session_factory,
            session.id,
            [
                TrajectoryRecord(
                    token_ids=list(prompt_ids) + output,
                    loss_mask=[False] * prompt_len + [True] * len(output),
                    logprobs=np.array([0.0] * prompt_len + logprobs, dtype=np.float32),
                    versions=[-1] * prompt_len + versions,
                    reward=reward,
                    temperature=temperature,
                )
            ],
        )
        outputs.append(output)
        rewards.append(reward)
        oldest.append(min(versions))
    return Rollout(group_id=group_id, outputs=outputs, rewards=rewards, min_version=min(oldest))


async def roll_out_until(
    stop: asyncio.Event,
    client: SGLangClient,
    session_factory: SessionFactory,
    prompts: Sequence[Sequence[int]],
    **kwargs: Any,
) -> list[Rollout]:
    """Roll out groups over `prompts`, round robin, until `stop` is set; returns them all."""
    done: list[Rollout] = []
    for i in itertools.count():
        if stop.is_set():
            break
        done.append(await rollout_group(client, session_factory, prompts[i % len(prompts)], seed=i, **kwargs))
    return done
