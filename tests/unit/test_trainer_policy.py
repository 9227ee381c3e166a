"""The policy's train step without Ray: on-policy ratios are 1, micro-batching changes nothing, several
updates per batch use a π_prox taken before the first, advantages move logprobs the right way."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.records import TrainingSample
from trainer.batching import collate
from trainer.config import AlgorithmConfig, LossConfig, TrainerConfig, UngroupedBaselineConfig
from trainer.policy import Policy


def _sample_from(
    model: torch.nn.Module,
    prompts: list[list[int]],
    per_prompt: int,
    new_tokens: list[int],
    temperature: float,
    seed: int = 0,
) -> list[TrainingSample]:
    """Sample from `model` itself, recording its logprobs: on-policy samples of version 0. Rewards are the
    sample index within its group; lengths vary with `new_tokens`, cycled."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for g, prompt in enumerate(prompts):
        for i in range(per_prompt):
            ids, logprobs = list(prompt), []
            with torch.no_grad():
                for _ in range(new_tokens[(g * per_prompt + i) % len(new_tokens)]):
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                    logp = torch.log_softmax(logits / temperature, dim=-1)
                    token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                    ids.append(token)
                    logprobs.append(float(logp[token]))
            n, p = len(ids), len(prompt)
            samples.append(
                TrainingSample(
                    trajectory_id=len(samples),
                    token_ids=np.array(ids, dtype=np.int32),
                    loss_mask=np.arange(n) >= p,
                    logprobs=np.array([0.0] * p + logprobs, dtype=np.float32),
                    versions=np.array([-1] * p + [0] * (n - p), dtype=np.int32),
                    reward=float(i),
                    group_id=f"g{g}",
                    temperature=temperature,
                )
            )
    return samples


PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def samples(tiny_model_dir: Path) -> list[TrainingSample]:
    policy = Policy(str(tiny_model_dir), TrainerConfig())
    return _sample_from(policy._model, PROMPTS, per_prompt=4, new_tokens=[6, 9, 3, 12], temperature=0.7)


def _params(policy: Policy) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in policy._model.named_parameters()}


def test_on_policy_samples_have_prox_equal_to_behaviour(tiny_model_dir: Path, samples: list) -> None:
    policy = Policy(str(tiny_model_dir), TrainerConfig(lr=1e-3))
    before = _params(policy)
    stats = policy.train_step(samples, current_version=0)
    assert stats["prox_behave/max_abs_diff"] < 1e-4  # trainer and sampler agree at T = 0.7
    assert stats["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["staleness/max"] == 0 and stats["temperature/mean"] == pytest.approx(0.7)
    assert stats["tokens/trained"] == sum(int(s.loss_mask.sum()) for s in samples)
    assert stats["reward/mean"] == pytest.approx(1.5) and stats["grad_norm"] > 0
    assert stats["entropy"] > 0 and np.isfinite(stats["loss"])
    assert any(not torch.equal(before[n], p) for n, p in _params(policy).items())


def test_staleness_is_current_version_minus_oldest_token(tiny_model_dir: Path, samples: list) -> None:
    policy = Policy(str(tiny_model_dir), TrainerConfig())
    stats = policy.train_step(samples, current_version=2)  # every generated token is version 0
    assert stats["staleness/mean"] == stats["staleness/max"] == 2


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_micro_batches_accumulate_to_the_whole_batch_update(
    tiny_model_dir: Path, samples: list, aggregation: str
) -> None:
    algorithm = AlgorithmConfig(loss=LossConfig(aggregation=aggregation))
    whole = Policy(str(tiny_model_dir), TrainerConfig(lr=1e-2, grad_clip=None, algorithm=algorithm))
    micro = Policy(
        str(tiny_model_dir), TrainerConfig(lr=1e-2, grad_clip=None, algorithm=algorithm, micro_batch_size=3)
    )
    whole_stats = whole.train_step(samples, 0)
    micro_stats = micro.train_step(samples, 0)
    assert micro_stats["loss"] == pytest.approx(whole_stats["loss"], rel=1e-5, abs=1e-7)
    assert micro_stats["grad_norm"] == pytest.approx(whole_stats["grad_norm"], rel=1e-5)
    # Gradients (left on the parameters by the step), not weights: Adam's first step is ≈ lr·sign(g),
    # which float noise flips where g ≈ 0.
    whole_grads = {name: p.grad for name, p in whole._model.named_parameters()}
    for name, param in micro._model.named_parameters():
        assert torch.allclose(param.grad, whole_grads[name], rtol=1e-4, atol=1e-7), name


def test_several_updates_per_batch_use_prox_from_before_the_first(
    tiny_model_dir: Path, samples: list
) -> None:
    policy = Policy(
        str(tiny_model_dir), TrainerConfig(lr=1e-2, ppo_epochs=2, minibatches=2, micro_batch_size=2)
    )
    stats = policy.train_step(samples, 0)
    assert stats["optim/updates"] == 4
    assert stats["prox_behave/max_abs_diff"] < 1e-4  # π_prox is still the sampling policy
    assert stats["kl/prox_theta"] > 0  # later updates see π_θ moved away from π_prox
    assert stats["ratio/max"] > 1.0


def test_advantages_move_logprobs_the_right_way(tiny_model_dir: Path, samples: list) -> None:
    policy = Policy(str(tiny_model_dir), TrainerConfig(lr=1e-3))
    group = [s for s in samples if s.group_id == "g0"]  # rewards 0, 1, 2, 3
    batch = collate(group)
    before, _ = policy._no_grad_logprobs(batch, with_entropy=False)
    policy.train_step(group, 0)
    after, _ = policy._no_grad_logprobs(batch, with_entropy=False)
    change = ((after - before) * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1)  # (B,)
    assert change[3] > 0 > change[0]  # best sample more likely, worst less


def test_kl_to_the_reference_starts_at_zero(tiny_model_dir: Path, samples: list) -> None:
    algorithm = AlgorithmConfig.model_validate({"loss": {"kl": {"coef": 0.1}}})
    policy = Policy(str(tiny_model_dir), TrainerConfig(lr=1e-2, algorithm=algorithm))
    assert policy.train_step(samples, 0)["kl/ref"] == pytest.approx(0.0, abs=1e-7)
    assert policy.train_step(samples, 0)["kl/ref"] > 0  # the policy has moved; the reference has not


def _alone(sample: TrainingSample, reward: float, key: str) -> TrainingSample:
    return dataclasses.replace(sample, group_id=None, reward=reward, baseline_key=key)


def test_a_running_baseline_measures_lone_samples_against_their_key(
    tiny_model_dir: Path, samples: list
) -> None:
    running = TrainerConfig(
        lr=1e-6, algorithm=AlgorithmConfig(ungrouped=UngroupedBaselineConfig(kind="running"))
    )
    policy = Policy(str(tiny_model_dir), running)
    first = policy.train_step([_alone(samples[0], 1.0, "key:a")], current_version=0)
    again = policy.train_step([_alone(samples[0], 1.0, "key:a")], current_version=0)
    other = policy.train_step([_alone(samples[0], 1.0, "key:b")], current_version=0)
    assert first["advantage/mean"] == pytest.approx(1.0)  # no history yet: the reward itself, never 0
    assert again["advantage/mean"] == pytest.approx(0.0)  # its key's average is 1 by now
    assert other["advantage/mean"] == pytest.approx(0.0)  # a new key starts from the average of all keys
    batch = Policy(str(tiny_model_dir), TrainerConfig(lr=1e-6))
    batch.train_step([_alone(samples[0], 1.0, "key:a")], current_version=0)
    assert batch.train_step([_alone(samples[0], 1.0, "key:a")], current_version=0)["advantage/mean"] == 1.0


def test_grouped_samples_keep_their_group_baseline_beside_lone_ones(
    tiny_model_dir: Path, samples: list
) -> None:
    running = TrainerConfig(
        lr=1e-6, algorithm=AlgorithmConfig(ungrouped=UngroupedBaselineConfig(kind="running"))
    )
    stats = Policy(str(tiny_model_dir), running).train_step(
        [*samples[:4], _alone(samples[4], 0.5, "key:a")], current_version=0
    )
    # Group g0 holds rewards 0..3 (mean 1.5, GRPO-normalised to mean 0); the lone sample adds 0.5 - 0.
    assert stats["advantage/mean"] == pytest.approx(0.5 / 5, abs=1e-5)


def test_going_back_to_a_checkpoint_restores_optimiser_moments_and_baselines(
    tiny_model_dir: Path, samples: list, tmp_path: Path
) -> None:
    running = TrainerConfig(
        lr=1e-3, algorithm=AlgorithmConfig(ungrouped=UngroupedBaselineConfig(kind="running"))
    )
    policy = Policy(str(tiny_model_dir), running)
    policy.train_step([_alone(samples[0], 1.0, "key:a")], current_version=0)
    saved = policy.save(str(tmp_path), 1, with_state=True)
    weights, moments = _params(policy), copy.deepcopy(policy._optimizer.state_dict()["state"])
    policy.train_step([_alone(samples[1], -3.0, "key:a")], current_version=1)
    assert not all(torch.equal(weights[n], p) for n, p in _params(policy).items())
    policy.load(saved)
    assert all(torch.equal(weights[n], p) for n, p in _params(policy).items())
    restored = policy._optimizer.state_dict()["state"]
    assert all(torch.equal(moments[i]["exp_avg"], restored[i]["exp_avg"]) for i in moments)
    again = policy.train_step([_alone(samples[0], 1.0, "key:a")], current_version=1)
    assert again["advantage/mean"] == pytest.approx(0.0)  # the baseline from before the step undone
