"""The "concatenated" export: one trajectory per conversation chain, outputs trained once each."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from rewards.concatenate import build_concatenated_trajectories, chain_reward, conversation_chains
from rewards.finalize import SessionRewards
from storage.records import CompletionRecord
from tests.support.completion_records import completion

NO_REWARD = SessionRewards(session=None, completions={})


def logprobs_of(record: CompletionRecord) -> list[float]:
    return np.asarray(record.output_logprobs, dtype=np.float32).tolist()


def test_a_three_turn_chain_is_one_sequence_masked_on_prompts() -> None:
    first = completion("a", [1, 2, 3], [10, 11], version=0)
    second = completion("b", [4, 5], [12, 13, 14], parent="a", version=1)
    third = completion("c", [6], [15], parent="b", version=2)

    rewards = SessionRewards(session=2.0, completions={"b": 0.5})
    [trajectory] = build_concatenated_trajectories([first, second, third], rewards)

    assert np.asarray(trajectory.token_ids).tolist() == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14, 6, 15]
    assert np.asarray(trajectory.loss_mask).tolist() == [
        False, False, False, True, True, False, False, True, True, True, False, True
    ]
    assert np.asarray(trajectory.versions).tolist() == [-1, -1, -1, 0, 1, -1, -1, 1, 2, 3, -1, 2]
    expected = [0.0] * 3 + logprobs_of(first) + [0.0] * 2 + logprobs_of(second) + [0.0] + logprobs_of(third)
    assert np.asarray(trajectory.logprobs).tolist() == expected
    assert trajectory.reward == 2.5  # the session reward plus the rewards along the chain
    assert trajectory.temperature == 0.7


def test_branches_train_a_shared_prefix_once() -> None:
    root = completion("a", [1], [10])
    left = completion("b", [2], [11], parent="a")
    right = completion("c", [3], [12, 13], parent="a")  # an edited retry of turn 2

    chains = conversation_chains([root, left, right])
    rewards = SessionRewards(session=1.0, completions={"c": 1.0})
    trajectories = build_concatenated_trajectories([root, left, right], rewards)

    assert [[c.id for c in chain] for chain in chains] == [["a", "b"], ["a", "c"]]
    assert [np.asarray(t.token_ids).tolist() for t in trajectories] == [[1, 10, 2, 11], [1, 10, 3, 12, 13]]
    assert np.asarray(trajectories[0].loss_mask).tolist() == [False, True, False, True]
    assert np.asarray(trajectories[1].loss_mask).tolist() == [False, False, False, True, True]
    assert np.asarray(trajectories[1].versions).tolist() == [-1, -1, -1, 0, 1]  # untrained: no version
    assert [t.reward for t in trajectories] == [1.0, 2.0]
    trained = sum(int(np.asarray(t.loss_mask).sum()) for t in trajectories)
    assert trained == 4  # every output token of the session, exactly once


def test_untrainable_completions_are_masked_and_an_all_masked_chain_is_dropped() -> None:
    root = completion("a", [1], [10])
    aborted = completion("b", [2], [11, 12], parent="a", finish="abort")
    unversioned = completion("c", [3], [13], parent="a", version=-1)
    second = completion("d", [4], [14], parent="a")

    trajectories = build_concatenated_trajectories([root, aborted, unversioned, second], NO_REWARD)

    # Chain a→b trains a; a→c has nothing left to train; a→d trains d.
    assert [np.asarray(t.loss_mask).tolist() for t in trajectories] == [
        [False, True, False, False, False], [False, False, False, True]
    ]


def test_mixed_temperatures_fall_back_to_individual_trajectories(caplog: pytest.LogCaptureFixture) -> None:
    first = completion("a", [1, 2], [10], temperature=0.7)
    second = completion("b", [3], [11, 12], parent="a", temperature=1.0)

    rewards = SessionRewards(session=1.0, completions={})
    with caplog.at_level(logging.WARNING):
        trajectories = build_concatenated_trajectories([first, second], rewards)

    assert "mixes sampling temperatures" in caplog.text
    assert [np.asarray(t.token_ids).tolist() for t in trajectories] == [[1, 2, 10], [1, 2, 10, 3, 11, 12]]
    assert [t.temperature for t in trajectories] == [0.7, 1.0]
    assert [np.asarray(t.loss_mask).tolist() for t in trajectories] == [
        [False, False, True], [False, False, False, False, True, True]
    ]
    assert [t.reward for t in trajectories] == [1.0, 1.0]


def test_single_turn_sessions_export_as_in_the_individual_style() -> None:
    one = completion("a", [1, 2], [10, 11])
    two = completion("b", [1, 2], [12])

    rewards = SessionRewards(session=None, completions={"a": 1.0})
    trajectories = build_concatenated_trajectories([one, two], rewards)

    assert [np.asarray(t.token_ids).tolist() for t in trajectories] == [[1, 2, 10, 11], [1, 2, 12]]
    assert [t.reward for t in trajectories] == [1.0, 0.0]
    assert chain_reward([one], SessionRewards(session=0.5, completions={"a": 1.0})) == 1.5


def test_a_missing_parent_is_an_error() -> None:
    with pytest.raises(ValueError, match="not in the session"):
        conversation_chains([completion("b", [2], [11], parent="gone")])
