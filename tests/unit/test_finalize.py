"""Trajectory building from completions and rewards: masks, alignment, prompt rebuilding, discounts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rewards.finalize import (
    RewardEntry,
    SessionRewards,
    build_session_trajectories,
    build_trajectory,
    combine_rewards,
    discounted_returns,
    full_prompts,
    is_trainable,
    turn_rewards,
)
from storage.sequences import full_prompt_ids
from tests.support.completion_records import completion


def test_trajectory_masks_the_prompt_and_aligns_output_arrays() -> None:
    c = completion("c1", [1, 2, 3], [10, 11], version=4, temperature=0.7)
    t = build_trajectory(np.array([1, 2, 3], dtype=np.int32), c, reward=2.5)
    assert list(t.token_ids) == [1, 2, 3, 10, 11]
    assert list(t.loss_mask) == [False, False, False, True, True]
    assert np.allclose(t.logprobs, [0.0, 0.0, 0.0, -0.1, -0.2])
    assert np.asarray(t.logprobs).dtype == np.float32
    assert list(t.versions) == [-1, -1, -1, 4, 5]
    assert t.reward == 2.5 and t.temperature == 0.7


def test_trajectory_rejects_misaligned_output_arrays() -> None:
    c = completion("c1", [1], [10, 11])
    bad = dataclasses.replace(c, output_versions=[0])
    with pytest.raises(ValueError, match="differ in length"):
        build_trajectory(np.array([1], dtype=np.int32), bad, reward=0.0)


def test_full_prompts_rebuild_each_chain_like_storage() -> None:
    root = completion("a", [1, 2], [3, 4])
    child = completion("b", [5], [6, 7], parent="a")
    grandchild = completion("c", [8, 9], [10], parent="b")
    other_root = completion("d", [20], [21])
    # Order must not matter: a child listed before its parent still resolves.
    prompts = full_prompts([grandchild, root, other_root, child])
    assert list(prompts["a"]) == [1, 2]
    assert list(prompts["b"]) == [1, 2, 3, 4, 5]
    assert list(prompts["c"]) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert list(prompts["d"]) == [20]
    assert list(prompts["c"]) == list(full_prompt_ids([root, child, grandchild]))


def test_full_prompts_need_the_parent() -> None:
    with pytest.raises(ValueError, match="not in the session"):
        full_prompts([completion("b", [5], [6], parent="missing")])


def test_discounted_returns_walk_backwards() -> None:
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == [1.0 + 0.5 * 1.0, 0.0 + 0.5 * 2.0, 2.0]
    assert discounted_returns([1.0, 0.0, 2.0], 1.0) == [3.0, 2.0, 2.0]
    assert discounted_returns([1.0, 0.0, 2.0], 0.0) == [1.0, 0.0, 2.0]
    assert discounted_returns([], 0.9) == []


def test_combine_rewards_latest_per_source_sums_sources() -> None:
    rewards = combine_rewards(
        [
            RewardEntry(value=1.0, source="rest"),
            RewardEntry(value=3.0, source="rest"),  # corrects the first
            RewardEntry(value=0.5, source="format"),
            RewardEntry(value=2.0, source="rest", completion_id="c1"),
            RewardEntry(value=-1.0, source="judge", completion_id="c1"),
            RewardEntry(value=4.0, source="rest", completion_id="c2"),
        ]
    )
    assert rewards.session == 3.5
    assert rewards.completions == {"c1": 1.0, "c2": 4.0}
    assert not rewards.empty
    assert combine_rewards([]).empty
    assert combine_rewards([RewardEntry(value=0.0, source="rest")]).session == 0.0


def test_session_reward_lands_on_the_last_turn() -> None:
    rewards = SessionRewards(session=10.0, completions={"a": 1.0, "zzz": 5.0})
    assert turn_rewards(["a", "b", "c"], rewards) == [1.0, 0.0, 10.0]
    assert turn_rewards([], rewards) == []


def test_exclusions() -> None:
    assert is_trainable(completion("a", [1], [2]))
    assert not is_trainable(completion("a", [1], [2], finish="abort"))
    assert not is_trainable(completion("a", [1], []))
    assert is_trainable(completion("a", [1], [2], finish="length"))


def test_session_trajectories_combine_discount_and_exclude() -> None:
    a = completion("a", [1, 2], [3, 4], version=0)
    aborted = completion("x", [1, 2, 3, 4, 50], [51], parent="a", finish="abort")
    b = completion("b", [5], [6, 7], parent="a", version=1)
    empty = completion("e", [9], [])
    c = completion("c", [8], [9], parent="b", version=2, temperature=1.0)
    rewards = SessionRewards(session=4.0, completions={"a": 1.0, "b": 2.0, "x": 100.0, "e": 100.0})

    trajectories = build_session_trajectories([a, aborted, b, empty, c], rewards, turn_discount=0.5)

    # Turns a, b, c: r = [1, 2, 0 + 4]; R_c = 4, R_b = 2 + 0.5·4 = 4, R_a = 1 + 0.5·4 = 3.
    assert [t.reward for t in trajectories] == [3.0, 4.0, 4.0]
    assert [list(t.token_ids) for t in trajectories] == [
        [1, 2, 3, 4],
        [1, 2, 3, 4, 5, 6, 7],
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
    ]
    last = trajectories[-1]
    assert list(last.loss_mask) == [False] * 8 + [True]
    assert list(last.versions) == [-1] * 8 + [2]
    assert last.temperature == 1.0 and trajectories[0].temperature == 0.7
    # Every trajectory's mask covers exactly its own completion's output.
    for t, source in zip(trajectories, [a, b, c], strict=True):
        out = np.asarray(t.token_ids)[np.asarray(t.loss_mask)]
        assert list(out) == list(source.output_ids)
        assert np.allclose(np.asarray(t.logprobs)[np.asarray(t.loss_mask)], source.output_logprobs)


def test_session_without_rewards_gets_zero() -> None:
    trajectories = build_session_trajectories(
        [completion("a", [1], [2])], SessionRewards(session=None, completions={}), turn_discount=1.0
    )
    assert [t.reward for t in trajectories] == [0.0]
