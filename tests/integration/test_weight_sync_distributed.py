"""The distributed weight push (`trainer.weights.strategy: distributed`) to two CPU engines over gloo:
what they serve after a push (the trainer's weights and label, token for token what a disk push gives),
pushes that fail halfway (a refused bucket, an engine killed between buckets) leaving every engine on its
old version whole, the request bodies against SGLang's own structs, and the driver training with it.

The engines are `flywheel engine` processes (a process joins a group of a name once; one gets killed);
the policy is rank 0 in this process, except in the driver test, where it is the Ray actor.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from serving.client import GenerateRequest, SamplingParams, SGLangClient
from serving.config import ServingConfig
from serving.models.loading import load_model
from storage.config import StorageConfig
from storage.engine import SessionFactory
from tests.support.engine_server import PROMPT, assert_logprobs_match
from tests.support.sglang_io_structs import check_body
from tests.support.trainer_driver import groups
from tests.support.weight_sync import (
    EngineProcess,
    LocalRank0,
    RecordingClient,
    engine_processes,
    on_bucket,
    perturbed_checkpoint,
)
from trainer.config import TrainerConfig, WeightPushConfig
from trainer.policy import Policy
from trainer.runner import train
from trainer.weights.disk import WeightPushError
from trainer.weights.distributed import DistributedSync

pytestmark = pytest.mark.slow

DISTRIBUTED = {"bucket_mb": 1.0, "timeout_s": 60.0}
"""1 MiB buckets: the tiny model's 3.5 MiB go in four."""
STRUCTS = {
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}
Sent = list[tuple[str, dict[str, Any]]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    with engine_processes(tiny_model_dir, 2, tmp_path_factory.mktemp("engines")) as running:
        yield running


@pytest.fixture
def rank0(tiny_model_dir: Path) -> Iterator[LocalRank0]:
    policy = Policy(str(tiny_model_dir), TrainerConfig(num_threads=1))
    yield LocalRank0(policy)
    policy.destroy_weight_group()  # whatever a failing test left


@pytest.fixture
async def sync(rank0: LocalRank0) -> AsyncIterator[DistributedSync]:
    config = WeightPushConfig.model_validate({"strategy": "distributed", "distributed": DISTRIBUTED})
    pushing = DistributedSync(config, rank0)
    yield pushing
    await pushing.close()


@pytest.fixture
async def sent() -> Sent:
    return []


@pytest.fixture
async def clients(engines: list[EngineProcess], sent: Sent) -> AsyncIterator[list[RecordingClient]]:
    recording = [RecordingClient(engine.url, sent) for engine in engines]
    yield recording
    for client in recording:
        await client.close()


class Served(NamedTuple):
    """What an engine serves: its label, and a greedy answer (its tokens and logprobs)."""

    label: str
    output_ids: list[int]
    logprobs: list[float]
    answer: dict[str, Any]

    def exactly(self) -> tuple[str, list[int], list[float]]:
        return self.label, self.output_ids, self.logprobs


async def served(client: SGLangClient) -> Served:
    info = await client.model_info()
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    request = GenerateRequest(input_ids=PROMPT, sampling_params=greedy, return_logprob=True)
    answer = await client.generate(request)
    assert isinstance(answer, dict)
    logprobs = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
    return Served(info["weight_version"], answer["output_ids"], logprobs, answer)


def assert_serves(state: Served, label: str, checkpoint: Path) -> None:
    """The engine serves `checkpoint` as `label`: its logprobs are the checkpoint's model's own."""
    assert state.label == label
    assert_logprobs_match(load_model(str(checkpoint)).model, PROMPT, state.answer, temperature=1.0)


async def test_push_reaches_both_engines_token_exact_with_a_disk_push(
    clients: list[RecordingClient], sync: DistributedSync, sent: Sent, tiny_model_dir: Path, tmp_path: Path
) -> None:
    checkpoint = perturbed_checkpoint(tiny_model_dir, tmp_path, 7, seed=7)
    before = [await served(c) for c in clients]
    await sync.push(clients, str(checkpoint), 7)
    after = [await served(c) for c in clients]
    for state in after:
        assert_serves(state, "7", checkpoint)
    assert after[0].exactly() == after[1].exactly()
    assert after[0].logprobs != before[0].logprobs  # the weights did change
    # The same checkpoint from disk: token for token, logprob for logprob, what the broadcast gave.
    await clients[1].update_weights_from_disk(str(checkpoint), "7")
    assert (await served(clients[1])).exactly() == after[1].exactly()
    # Version 0 comes from the model directory itself.
    await sync.push(clients, str(tiny_model_dir), 0)
    for state in [await served(c) for c in clients]:
        assert_serves(state, "default", tiny_model_dir)


async def test_request_bodies_are_sglangs(
    sglang_api_types: Any, clients: list[RecordingClient], sync: DistributedSync, sent: Sent,
    tiny_model_dir: Path,
) -> None:
    await sync.push(clients, str(tiny_model_dir), 0)
    await sync.close()
    paths = {path for path, _ in sent}
    assert set(STRUCTS) <= paths
    for path, body in sent:
        if path in STRUCTS:
            check_body(STRUCTS[path], body)
    buckets = [body for path, body in sent if path == "/update_weights_from_distributed"]
    labelled = [body for body in buckets if "weight_version" in body]
    assert len(labelled) == 2 and labelled == buckets[-2:]  # the last bucket of each engine
    assert [body["flush_cache"] for body in buckets] == [False] * (len(buckets) - 2) + [True, True]


def _reversed_shape(body: dict[str, Any]) -> dict[str, Any]:
    """The bucket with one matrix described transposed: the same bytes, a shape the model lacks."""
    shapes = [list(shape) for shape in body["shapes"]]
    index = next(i for i, shape in enumerate(shapes) if len(shape) == 2 and shape[0] != shape[1])
    shapes[index] = shapes[index][::-1]
    return {**body, "shapes": shapes}


async def test_a_refused_bucket_leaves_every_engine_on_its_old_version(
    clients: list[RecordingClient], sync: DistributedSync, tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = perturbed_checkpoint(tiny_model_dir, tmp_path, 1, seed=1)
    second = perturbed_checkpoint(tiny_model_dir, tmp_path, 2, seed=2)
    await sync.push(clients, str(first), 1)
    old = [await served(c) for c in clients]
    clients[1].tamper = on_bucket(2, _reversed_shape)
    with pytest.raises(WeightPushError, match=clients[1].base_url):
        await sync.push(clients, str(second), 2)
    # The other engine had staged two buckets: it serves neither, the old label and weights whole.
    assert [(await served(c)).exactly() for c in clients] == [state.exactly() for state in old]
    clients[1].tamper = None
    await sync.push(clients, str(second), 2)  # the group is made again and the push goes through
    for state in [await served(c) for c in clients]:
        assert_serves(state, "2", second)


async def test_an_engine_killed_between_buckets_leaves_the_other_on_its_old_version(
    engines: list[EngineProcess], clients: list[RecordingClient], sync: DistributedSync, tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    first = perturbed_checkpoint(tiny_model_dir, tmp_path, 3, seed=3)
    second = perturbed_checkpoint(tiny_model_dir, tmp_path, 4, seed=4)
    await sync.push(clients, str(first), 3)
    old = await served(clients[0])

    def kill(body: dict[str, Any]) -> dict[str, Any]:
        engines[1].kill()
        return body

    clients[1].tamper = on_bucket(3, kill)
    with pytest.raises(WeightPushError):
        await sync.push(clients, str(second), 4)
    assert (await served(clients[0])).exactly() == old.exactly()
    clients[1].tamper = None
    engines[1].start()  # recovery: the engine comes back with its initial weights
    engines[1].wait_healthy()
    assert (await served(clients[1])).label == "default"
    await sync.push(clients, str(second), 4)
    for state in [await served(c) for c in clients]:
        assert_serves(state, "4", second)


@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
async def test_the_driver_trains_with_the_distributed_push(
    engines: list[EngineProcess], db_url: str, session_factory: SessionFactory, tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    await groups(session_factory, 2)  # one group a step; staleness 1 is allowed for the second
    async with SGLangClient(engines[0].url, ServingConfig(model=str(tiny_model_dir)).client) as client:
        await client.pause_generation()  # as a trainer that died mid-push leaves a worker
        await client.begin_weight_update()
    config = TrainerConfig.model_validate({
        "batch_size": 2, "lr": 1e-2, "num_threads": 1, "poll_interval_s": 0.05, "total_steps": 2,
        "max_head_offpolicyness": 1, "weights": {"strategy": "distributed", "distributed": DISTRIBUTED},
    })
    urls = [engine.url for engine in engines]
    version = await train(config, StorageConfig(url=db_url), ServingConfig(model=str(tiny_model_dir)), urls,
                          tmp_path)
    assert version == 2
    for url in urls:
        async with SGLangClient(url, ServingConfig(model=str(tiny_model_dir)).client) as client:
            assert_serves(await served(client), "2", tmp_path / "checkpoints" / "v000002")
