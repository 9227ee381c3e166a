"""Online training with the tiny model, for the online-loop test and benchmark: simulated users who chat
through online keys and give feedback late and out of order, the reward they judge by, and the policy
run in this process (so a test can damage one update on purpose).

The reward: the fraction of an answer's tokens drawn from a fixed set of 64 target token ids. The tiny
random model starts near |set| / |vocab| and learns it within a few dozen samples (the dense reward of
tests/integration/test_trainer_learning.py), so promotion sees real progress.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

from rewards.config import EvalConfig
from rewards.evaluation import open_evaluator
from rewards.hooks.contract import SessionInput
from rewards.hooks.spec import HookSpec
from serving.client import WorkerPool
from serving.config import ClientConfig, CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import load_model
from storage.engine import SessionFactory
from storage.records import TrainingSample
from trainer.algos.config import UngroupedBaselineConfig
from trainer.config import AlgorithmConfig, PromotionConfig, TrainerConfig
from trainer.driver import Driver, PolicyHandle
from trainer.monitor import Monitor
from trainer.policy import Policy

TARGET = frozenset(range(300, 364))
EVAL_PROMPTS = ("Hello.", "Tell me a story.", "What is 2 + 2?", "Name a colour.", "Say something.", "Why?")


def target_fraction(output_ids: Sequence[int]) -> float:
    return sum(token in TARGET for token in output_ids) / max(len(output_ids), 1)


def target_reward(session: SessionInput) -> float:
    """A native reward hook: the target fraction of the session's final answer (the eval set's score)."""
    final = session.final
    return 0.0 if final is None else target_fraction(final.output_ids)


@contextmanager
def two_engines(model_dir: Path, context_length: int | None = None) -> Iterator[tuple[str, str]]:
    """(serving worker, eval worker): two CPU engines on the tiny model."""
    cpu = CpuEngineConfig(num_threads=1, max_batch_size=16)
    if context_length is not None:
        cpu = cpu.model_copy(update={"context_length": context_length})
    config = ServingConfig(model=str(model_dir), cpu=cpu)
    with (
        serve_in_thread(create_engine_app(config, load_model(str(model_dir)))) as serving,
        serve_in_thread(create_engine_app(config, load_model(str(model_dir)))) as evaluating,
    ):
        yield serving, evaluating


def online_trainer_config(batch_size: int, margin: float) -> TrainerConfig:
    """A trainer that learns the target reward fast, with running baselines and gated promotion."""
    return TrainerConfig(
        batch_size=batch_size,
        lr=1e-2,
        num_threads=1,
        seed=0,
        poll_interval_s=0.2,
        keep_checkpoints=2,
        algorithm=AlgorithmConfig(ungrouped=UngroupedBaselineConfig(kind="running", decay=0.8)),
        promotion=PromotionConfig(enabled=True, margin=margin),
    )


@asynccontextmanager
async def gated_driver(
    config: TrainerConfig,
    session_factory: SessionFactory,
    policy: PolicyHandle,
    serving_url: str,
    eval_url: str,
    model_dir: Path,
    work_dir: Path,
    max_new_tokens: int = 16,
) -> AsyncIterator[Driver]:
    """The driver with the real evaluator on `eval_url`, scoring the eval set by `target_reward`."""
    evaluation = EvalConfig(
        dataset=str(write_eval_set(work_dir / "eval.jsonl")),
        worker_url=eval_url,
        max_new_tokens=max_new_tokens,
        hook=HookSpec(hook="tests.support.online_loop:target_reward"),
    )
    async with (
        WorkerPool(ClientConfig(), [serving_url]) as pool,
        open_evaluator(evaluation, model_dir) as gate,
    ):
        yield Driver(
            config,
            session_factory,
            policy,
            pool.clients,
            work_dir / "ckpt",
            Monitor(work_dir / "metrics.jsonl"),
            gate=gate,
        )


def write_eval_set(path: Path) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"e{i}", "prompt": p}) + "\n" for i, p in enumerate(EVAL_PROMPTS))
    )
    return path


class LocalPolicy:
    """`trainer.policy.Policy` in this process, each call in a thread (the driver's `PolicyHandle`).
    `damage_next_step()` zeroes every weight right after the next training step: a broken update that
    gated promotion must reject."""

    def __init__(self, model_dir: Path, config: TrainerConfig) -> None:
        self.policy = Policy(str(model_dir), config)
        self._damage = False

    def damage_next_step(self) -> None:
        self._damage = True

    async def train_step(self, samples: Sequence[TrainingSample], current_version: int) -> dict[str, float]:
        stats = await asyncio.to_thread(self.policy.train_step, samples, current_version)
        if self._damage:
            self._damage = False
            with torch.no_grad():
                for parameter in self.policy._model.parameters():
                    parameter.zero_()
            stats["damaged"] = 1.0
        return stats

    async def save(self, checkpoint_dir: str, version: int, with_state: bool = True) -> str:
        path = await asyncio.to_thread(self.policy.save, checkpoint_dir, version, with_state)
        return path

    async def load(self, checkpoint_path: str) -> None:
        await asyncio.to_thread(self.policy.load, checkpoint_path)

    async def model_dir(self) -> str:
        return self.policy.model_dir()


@dataclass
class UserStats:
    turns: int = 0
    conversations: int = 0
    feedback: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    feedback_sent_at: list[float] = field(default_factory=list)  # monotonic times feedback was answered
    latencies_s: list[float] = field(default_factory=list)  # chat call latencies


class SimulatedUsers:
    """`users` people, each on an online key of their own, each holding one conversation at a time (two
    turns, then a new conversation, which ends the last); after every turn they judge the answer and
    send feedback after a random delay, so feedback arrives late (often after the conversation ended)
    and out of order."""

    def __init__(
        self,
        base_url: str,
        keys: Sequence[str],
        *,
        max_tokens: int = 16,
        turns: int = 2,
        feedback_delay_s: tuple[float, float] = (0.1, 2.5),
        seed: int = 0,
    ) -> None:
        self._base_url = base_url
        self._keys = list(keys)
        self._max_tokens = max_tokens
        self._turns = turns
        self._delay = feedback_delay_s
        self._random = random.Random(seed)
        self.stats = UserStats()
        self._pending: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> UserStats:
        async with httpx.AsyncClient(base_url=self._base_url, timeout=60) as http:
            users = [self._user(key, index, http, stop) for index, key in enumerate(self._keys)]
            await asyncio.gather(*users)
            if self._pending:
                await asyncio.gather(*self._pending)
        return self.stats

    async def _user(self, key: str, index: int, http: httpx.AsyncClient, stop: asyncio.Event) -> None:
        client = openai.AsyncOpenAI(base_url=f"{self._base_url}/v1", api_key=key, max_retries=2)
        try:
            while not stop.is_set():
                messages: list[dict[str, Any]] = [{"role": "user", "content": f"user {index} says hi"}]
                self.stats.conversations += 1
                for turn in range(self._turns):
                    started = time.perf_counter()
                    try:
                        answer = await client.chat.completions.create(
                            model="m",
                            messages=messages,
                            max_tokens=self._max_tokens,  # type: ignore[arg-type]
                            temperature=1.0,
                            extra_body={"return_token_ids": True},
                        )
                    except openai.APIError as exc:
                        self.stats.errors.append(f"chat: {exc}")
                        break
                    self.stats.latencies_s.append(time.perf_counter() - started)
                    self.stats.turns += 1
                    choice = answer.choices[0]
                    value = target_fraction(choice.model_extra.get("token_ids") or [])  # type: ignore[union-attr]
                    task = asyncio.create_task(self._feedback(http, key, answer.id, value))
                    self._pending.add(task)
                    task.add_done_callback(self._pending.discard)
                    messages += [
                        # A random model writes NULs, which no JSON body may carry to the database (a
                        # person would not see them either).
                        {"role": "assistant", "content": (choice.message.content or "").replace(chr(0), "")},
                        {"role": "user", "content": f"and then? ({turn})"},
                    ]
        finally:
            await client.close()

    async def _feedback(self, http: httpx.AsyncClient, key: str, completion_id: str, value: float) -> None:
        await asyncio.sleep(self._random.uniform(*self._delay))
        body = {"completion_id": completion_id, "value": value}
        response = await http.post("/rl/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"})
        if response.status_code != 201:
            self.stats.errors.append(f"feedback {response.status_code}: {response.text}")
            return
        self.stats.feedback[response.json()["state"]] += 1
        self.stats.feedback_sent_at.append(time.monotonic())
