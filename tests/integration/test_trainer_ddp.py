"""Data-parallel training (trainer/distributed/): two ranks in DistributedDataParallel over gloo take the
update one policy takes on the same batch, on one Ray node and with one rank on each of two Ray nodes.

"The same update" is checked on the weights: max |w_ranks − w_one| ≤ 1e-5 after each step (fp32). AdamW
runs with ε = 1 here, so that its step, lr·g/(|g| + ε), is about lr·g, linear in the gradient: a wrong
share of the loss (a rank's rows dropped, counted twice, or weighted by its own denominator instead of
the minibatch's) moves weights by far more than that. With the default ε the first step is ≈ lr·sign(g),
which float noise flips where g ≈ 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from serving.models.loading import SAFETENSORS_FILE
from tests.support.ray_nodes import synthetic_samples, train_on_cluster, two_ray_nodes
from trainer.config import TrainerConfig
from trainer.distributed.handle import DistributedPolicy
from trainer.policy import Policy
from trainer.runner import start_policy

pytestmark = pytest.mark.slow

WEIGHT_TOLERANCE = 1e-5
STEP = {
    "lr": 1.0,
    "adam_eps": 1.0,
    "grad_clip": None,
    "minibatches": 2,  # two optimiser steps per batch, on π_prox from a no-grad pass split over the ranks
    "micro_batch_tokens": 40,  # several micro-batches per rank: packing, accumulation and no_sync
}


def _config(**ray: Any) -> TrainerConfig:
    # A rank left waiting at a collective fails the test after a while rather than hanging it.
    ray = {"collective_timeout_s": 120, "placement_timeout_s": 120, **ray}
    return TrainerConfig.model_validate({**STEP, "num_threads": 1, "ray": ray})


def _reference(model_dir: Path) -> Policy:
    """One policy in this process, trained on the same batches."""
    return Policy(str(model_dir), TrainerConfig.model_validate(STEP))


def _weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    return load_file(Path(checkpoint) / SAFETENSORS_FILE)


def _max_weight_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert got.keys() == expected.keys()
    return max(float((got[name] - expected[name]).abs().max()) for name in expected)


def _assert_same_stats(got: dict[str, float], expected: dict[str, float]) -> None:
    timing = {name for name in expected if name.startswith("perf/")}
    assert got.keys() == expected.keys()
    for name in expected.keys() - timing:
        assert got[name] == pytest.approx(expected[name], rel=1e-4, abs=1e-6), name


@pytest.mark.usefixtures("ray_cluster")
async def test_two_ranks_take_the_update_one_policy_takes(tiny_model_dir: Path, tmp_path: Path) -> None:
    reference = _reference(tiny_model_dir)
    initial = _weights(reference.save(str(tmp_path / "initial"), 0))
    policy = start_policy(str(tiny_model_dir), _config(num_workers=2))
    assert isinstance(policy, DistributedPolicy)
    try:
        # 7 rows: minibatches of 4 and 3 rows, shared unevenly; then 3 rows: minibatches of 2 and 1, where
        # rank 1 has nothing to train and must still take part in the all-reduce.
        for version, samples in enumerate([synthetic_samples(7, seed=1), synthetic_samples(3, seed=2)], 1):
            expected_stats = reference.train_step(samples, 0)
            got_stats = await policy.train_step(samples, 0)
            _assert_same_stats(got_stats, expected_stats)
            expected = _weights(reference.save(str(tmp_path / "one"), version))
            got = _weights(await policy.save(str(tmp_path / "ranks"), version))
            print(f"step {version}: max |w_ranks - w_one| = {_max_weight_diff(got, expected):.2e}")
            assert _max_weight_diff(got, expected) <= WEIGHT_TOLERANCE
            assert _max_weight_diff(expected, initial) > 100 * WEIGHT_TOLERANCE  # the step did move them
            initial = expected
        assert await policy.call_rank0("model_dir") == str(tiny_model_dir)
        await policy.load(reference.save(str(tmp_path / "one"), 9))  # every rank loads it
        samples = synthetic_samples(4, seed=3)
        _assert_same_stats(await policy.train_step(samples, 0), reference.train_step(samples, 0))
    finally:
        policy.kill()


def test_one_rank_on_each_of_two_ray_nodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    with two_ray_nodes(cpus_per_node=1) as nodes:
        config = _config(address=nodes.address, num_workers=2, placement_strategy="STRICT_SPREAD")
        spec = {
            "config": config.model_dump(mode="json"),
            "nodes": 2,
            "model": str(tiny_model_dir),
            "samples": 5,
            "seed": 4,
            "checkpoint_dir": str(tmp_path / "ranks"),
        }
        report = train_on_cluster(spec)
    assert len(report["nodes"]) == 2
    assert sorted(report["rank_nodes"]) == report["nodes"]  # one rank on each node
    reference = _reference(tiny_model_dir)
    expected_stats = reference.train_step(synthetic_samples(5, seed=4), 0)
    _assert_same_stats(report["stats"], expected_stats)
    expected = _weights(reference.save(str(tmp_path / "one"), 1))
    assert _max_weight_diff(_weights(report["checkpoint"]), expected) <= WEIGHT_TOLERANCE
