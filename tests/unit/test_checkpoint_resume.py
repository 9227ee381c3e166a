"""Exact resume: a checkpoint holds what the next step needs (weights, optimiser state, running baselines,
random generators), so a policy loaded from it takes the step an uninterrupted one takes; checkpoints are
written atomically; retention keeps the trainer state only where training may go on from."""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import trainer.checkpoint as checkpoint_module
from serving.models.loading import load_model
from tests.support.trainer_crash import fixed_samples, max_difference, weights
from trainer.checkpoint import (
    TRAINER_STATE,
    checkpoint_name,
    discard_unrecorded,
    forget_claim,
    list_checkpoints,
    load_trainer_state,
    prune_checkpoints,
    remember_claim,
    remembered_claim,
    save_checkpoint,
)
from trainer.config import AlgorithmConfig, TrainerConfig, UngroupedBaselineConfig
from trainer.policy import Policy

TOLERANCE = 1e-6
"""Largest weight difference allowed between a resumed and an uninterrupted step: on CPU in fp32 with the
same thread count the two run the same kernels on the same inputs and agree bit for bit (0)."""

# Several shuffled minibatches and epochs (the shuffle generator matters), lone samples measured against a
# running baseline (the baselines matter), a learning rate at which AdamW's moments show.
CONFIG = TrainerConfig(
    lr=1e-3,
    ppo_epochs=2,
    minibatches=2,
    num_threads=1,
    algorithm=AlgorithmConfig(ungrouped=UngroupedBaselineConfig(kind="running")),
)


@pytest.fixture(autouse=True)
def _keep_thread_count():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _batches() -> list[list]:
    samples = fixed_samples(count=8, length=24, lone=4)
    grouped, lone = samples[:8], samples[8:]
    return [grouped[:4] + lone[:2], grouped[4:] + lone[2:]]


def test_a_resumed_policy_takes_the_step_an_uninterrupted_one_takes(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    first, second = _batches()
    uninterrupted = Policy(str(tiny_model_dir), CONFIG)
    uninterrupted.train_step(first, current_version=0)
    path = uninterrupted.save(str(tmp_path), 1)
    expected = uninterrupted.train_step(second, current_version=1)

    restarted = Policy(str(tiny_model_dir), CONFIG)  # a fresh process: initial weights, fresh optimiser
    restarted.load(path)
    resumed = restarted.train_step(second, current_version=1)

    assert max_difference(weights(restarted), weights(uninterrupted)) <= TOLERANCE
    assert resumed["advantage/mean"] == expected["advantage/mean"]  # the running baselines came back
    assert resumed["loss"] == pytest.approx(expected["loss"], abs=TOLERANCE)


def test_the_checkpoint_holds_every_generator_and_the_step_config(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    policy = Policy(str(tiny_model_dir), CONFIG)
    policy.train_step(_batches()[0], current_version=0)
    path = policy.save(str(tmp_path), 1)
    draws = (torch.rand(3), torch.randperm(8, generator=policy._shuffle), random.random(), np.random.rand())

    state = load_trainer_state(Path(path))
    assert state is not None
    assert state["version"] == 1 and state["step_config"]["minibatches"] == 2
    assert set(state["rng"]) >= {"torch", "shuffle", "python", "numpy"}
    assert state["optimizer"]["state"]  # AdamW's moments after one step

    other = Policy(str(tiny_model_dir), CONFIG.model_copy(update={"seed": 7}))
    other.load(path)
    again = (torch.rand(3), torch.randperm(8, generator=other._shuffle), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and torch.equal(draws[1], again[1])
    assert draws[2:] == again[2:]


def test_a_changed_config_wins_over_the_saved_hyperparameters_and_is_logged(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = Policy(str(tiny_model_dir), CONFIG)
    policy.train_step(_batches()[0], current_version=0)
    path = policy.save(str(tmp_path), 1)
    lower = Policy(str(tiny_model_dir), CONFIG.model_copy(update={"lr": 1e-5}))
    with caplog.at_level(logging.WARNING, logger="trainer.train_state"):
        lower.load(path)
    assert {group["lr"] for group in lower._optimizer.param_groups} == {1e-5}
    assert lower._optimizer.state  # the moments still came back
    assert "['lr']" in caplog.text


def test_every_file_is_on_disk_before_the_directory_appears(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(tiny_model_dir)).model
    flushed: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(checkpoint_module.os, "fsync", recording_fsync)
    path = save_checkpoint(model, tiny_model_dir, tmp_path, version=3, state={"version": 3})
    files = {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}
    assert str(TRAINER_STATE) in files and "model.safetensors" in files
    temporary = Path(flushed[0]).relative_to(tmp_path).parts[0]  # written under a temporary name
    assert temporary.startswith(".v000003.tmp-")
    before_rename = {str(Path(f).relative_to(tmp_path / temporary)) for f in flushed[:-1]}
    assert files <= before_rename  # each file, the state too, flushed before the rename
    assert flushed[-1] == str(tmp_path)  # then the rename itself


def _fake_checkpoints(root: Path, versions: range) -> None:
    for version in versions:
        path = root / checkpoint_name(version)
        (path / TRAINER_STATE).parent.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"w")
        (path / TRAINER_STATE).write_bytes(b"s")


def test_retention_keeps_the_state_only_where_training_may_go_on(tmp_path: Path) -> None:
    _fake_checkpoints(tmp_path, range(1, 7))
    # Keep 3, protect the served (2) and the best (4); training goes on from 6, the best may be returned to.
    removed = prune_checkpoints(tmp_path, keep=3, protect={2, 4}, resumable={4, 6})
    assert sorted(p.name for p in removed) == ["v000001", "v000003"]
    kept = list_checkpoints(tmp_path)
    assert list(kept) == [2, 4, 5, 6]
    assert all((path / "model.safetensors").is_file() for path in kept.values())  # all still servable
    assert [v for v, path in kept.items() if (path / TRAINER_STATE).is_file()] == [4, 6]
    assert not (kept[5] / TRAINER_STATE.parent).exists()

    prune_checkpoints(tmp_path, keep=None, protect=set(), resumable={6})  # keep all weights, still prune
    assert list(list_checkpoints(tmp_path)) == [2, 4, 5, 6]
    assert [v for v, path in kept.items() if (path / TRAINER_STATE).is_file()] == [6]


def test_checkpoints_of_unrecorded_versions_are_discarded(tmp_path: Path) -> None:
    _fake_checkpoints(tmp_path, range(1, 5))
    (tmp_path / ".v000005.tmp-abcd").mkdir()  # a save that died
    removed = discard_unrecorded(tmp_path, newest_recorded=2)
    assert sorted(p.name for p in removed) == ["v000003", "v000004"]
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["v000001", "v000002"]


def test_the_claim_in_flight_is_remembered_until_forgotten(tmp_path: Path) -> None:
    assert remembered_claim(tmp_path) is None
    remember_claim(tmp_path / "ckpt", "claim-1")
    remember_claim(tmp_path / "ckpt", "claim-2")
    assert remembered_claim(tmp_path / "ckpt") == "claim-2"
    forget_claim(tmp_path / "ckpt")
    assert remembered_claim(tmp_path / "ckpt") is None
    assert list_checkpoints(tmp_path / "ckpt") == {}
