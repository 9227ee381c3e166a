"""The tiny random model learns a dense reward through the whole stack: groups sampled by the CPU engine
(real logprobs and versions), GRPO in the Ray actor, checkpoints pushed back to the engine.

Reward: the fraction of generated tokens drawn from a fixed set of target token ids. At the start the
model spreads its probability almost evenly over ~1,000 tokens, so the reward is about |set| / |vocab|.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from serving.client import WorkerPool
from serving.config import ClientConfig, CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import load_model
from storage.engine import SessionFactory
from tests.support.rollouts import rollout_group
from trainer.config import TrainerConfig
from trainer.driver import Driver
from trainer.monitor import Monitor
from trainer.runner import start_policy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

TARGET = frozenset(range(300, 364))  # 64 of the tiny model's ~1,030 token ids
PROMPTS = [[11, 42, 97, 300], [64, 3, 250, 9, 17], [500, 501, 502], [7, 8, 900, 901, 12, 40]]
STEPS = 20
GROUP_SIZE = 8
MAX_NEW_TOKENS = 16
WINDOW = 4  # steps averaged at each end
MARGIN = 0.4  # the last steps' mean reward must beat the first steps' by this much (absolute; ~0.9 seen)


def target_fraction(output: Sequence[int]) -> float:
    return sum(token in TARGET for token in output) / max(len(output), 1)


@pytest.fixture
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    config = ServingConfig(model=str(tiny_model_dir), cpu=CpuEngineConfig(num_threads=1, max_batch_size=32))
    with serve_in_thread(create_engine_app(config, load_model(str(tiny_model_dir)))) as url:
        yield url


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # learning is not about the database
async def test_the_tiny_model_learns_a_dense_reward(
    session_factory: SessionFactory, engine_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    config = TrainerConfig(
        batch_size=len(PROMPTS) * GROUP_SIZE, lr=1e-2, num_threads=1, seed=0, keep_checkpoints=1
    )
    policy = start_policy(str(tiny_model_dir), config)
    rewards: list[float] = []
    try:
        async with WorkerPool(ClientConfig(), [engine_url]) as pool:
            for step in range(STEPS):
                groups = [
                    await rollout_group(
                        pool.clients[0],
                        session_factory,
                        prompt,
                        group_size=GROUP_SIZE,
                        max_new_tokens=MAX_NEW_TOKENS,
                        temperature=1.0,
                        reward_fn=target_fraction,
                        seed=1000 * step + i,
                    )
                    for i, prompt in enumerate(PROMPTS)
                ]
                assert all(g.min_version == step for g in groups)  # sampled by the weights just pushed
                rewards.append(statistics.fmean(r for g in groups for r in g.rewards))
                one_step = config.model_copy(update={"total_steps": step + 1})
                driver = Driver(
                    one_step,
                    session_factory,
                    policy,
                    pool.clients,
                    tmp_path / "ckpt",
                    Monitor(tmp_path / "metrics.jsonl"),
                )
                assert await driver.run() == step + 1
    finally:
        policy.kill()
    first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
    print(f"reward per step: {[round(r, 3) for r in rewards]}")
    assert last >= first + MARGIN, f"reward {first:.3f} -> {last:.3f}: {rewards}"
