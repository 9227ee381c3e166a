"""LoRA end to end: the CPU engine serves adapters pushed as the trainer pushes them, with the logprobs the
trainer recomputes under the same adapter; the push's bodies are SGLang's; the proxy names the adapter in
every request; and a LoRA run of the tiny model learns the dense reward of test_trainer_learning.py with
adapter-only checkpoints."""

from __future__ import annotations

import asyncio
import json
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

from serving.client import GenerateRequest, SGLangClient, WorkerPool, encode_generate_body
from serving.config import ClientConfig, CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.errors import WorkerBadRequest
from serving.models.loading import SAFETENSORS_FILE, load_model
from storage.engine import SessionFactory
from tests.support.lora import AdapterClient, lora_proxy, perturbed_adapter, recomputation_gap
from tests.support.rollouts import rollout_group
from tests.support.sglang_io_structs import check_body
from tests.support.weight_sync import RecordingClient
from trainer.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS, list_checkpoints
from trainer.config import LORA_TARGET_MODULES, KLConfig, LoraConfig, TrainerConfig, WeightPushConfig
from trainer.driver import Driver
from trainer.monitor import Monitor
from trainer.policy import Policy
from trainer.runner import lora_sync, start_policy
from trainer.weights.disk import WeightPushError
from trainer.weights.lora import LoraSync

ADAPTER = "policy"
PROMPT = [11, 42, 97, 300]
TOLERANCE = 1e-4  # the engine/trainer agreement test_trainer_loop.py asks of full-weight training


@pytest.fixture
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    config = ServingConfig(model=str(tiny_model_dir), cpu=CpuEngineConfig(num_threads=1, max_batch_size=32))
    with serve_in_thread(create_engine_app(config, load_model(str(tiny_model_dir)))) as url:
        yield url


def _policies(model_dir: Path, adapter: Path) -> tuple[Policy, Policy]:
    """The trainer holding `adapter`, and the trainer of the base model."""
    with_adapter = Policy(str(model_dir), TrainerConfig(lora=LoraConfig(), num_threads=1))
    with_adapter.load(str(adapter))
    return with_adapter, Policy(str(model_dir), TrainerConfig(num_threads=1))


def _generated(answer: dict) -> tuple[list[int], list[float]]:
    return answer["output_ids"], [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]


async def test_the_engine_serves_a_pushed_adapter_with_the_trainers_logprobs(
    engine_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = perturbed_adapter(tiny_model_dir, tmp_path / "ckpt", 1, seed=0)
    sync = LoraSync(WeightPushConfig(), ADAPTER, initial_adapter=str(tmp_path / "unused"))
    sampling = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7}
    async with SGLangClient(engine_url, ClientConfig()) as client:
        await sync.push([client], str(adapter), 1)
        assert (await client.model_info())["weight_version"] == "1"
        # One batch, one row on the adapter and one on the base model.
        rows = await client.generate(
            {"input_ids": [PROMPT, PROMPT], "lora_path": [ADAPTER, None], "return_logprob": True,
             "sampling_params": sampling}
        )
        assert isinstance(rows, list)
        adapted, base = (_generated(row) for row in rows)

        await client.unload_lora_adapter(ADAPTER)
        named = {"input_ids": PROMPT, "lora_path": ADAPTER, "sampling_params": sampling}
        with pytest.raises(WorkerBadRequest, match=f"adapters are not loaded: {ADAPTER}"):
            await client.generate(named)
        with pytest.raises(WorkerBadRequest, match="does not exist"):
            await client.unload_lora_adapter(ADAPTER)
        with pytest.raises(WorkerBadRequest, match="adapters are not loaded: elsewhere"):
            await client.generate({**named, "lora_path": "elsewhere"})
        with pytest.raises(WorkerBadRequest, match="not a readable LoRA adapter"):
            await client.load_lora_adapter(ADAPTER, str(tiny_model_dir))  # a full model, not an adapter
        plain = await client.generate({**named, "lora_path": None, "return_logprob": True})
        assert isinstance(plain, dict)
        tokens, logprobs = _generated(plain)  # the base model serves on, as before
        assert tokens == base[0] and logprobs == pytest.approx(base[1], abs=1e-5)

        broken = tmp_path / "broken" / "v000002"  # a config without its weights
        broken.mkdir(parents=True)
        (broken / ADAPTER_CONFIG).write_text((adapter / ADAPTER_CONFIG).read_text())
        with pytest.raises(WeightPushError, match=engine_url):
            await sync.push([client], str(broken), 2)
        assert (await client.model_info())["weight_version"] == "1"
        # Generation was continued after the failed push.
        assert await asyncio.wait_for(client.generate({**named, "lora_path": None}), 30)

    lora_policy, base_policy = _policies(tiny_model_dir, adapter)
    assert recomputation_gap(lora_policy, PROMPT, *adapted) < TOLERANCE
    assert recomputation_gap(base_policy, PROMPT, *base) < TOLERANCE
    assert recomputation_gap(base_policy, PROMPT, *adapted) > 100 * TOLERANCE  # the adapter matters


STRUCTS = {  # sglang's io_struct.py class of each control body a LoRA push sends
    "/pause_generation": "PauseGenerationReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
}


async def test_lora_bodies_are_sglangs(
    sglang_api_types: ModuleType, engine_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = perturbed_adapter(tiny_model_dir, tmp_path / "ckpt", 1, seed=0)
    sent: list[tuple[str, dict[str, Any]]] = []
    async with RecordingClient(engine_url, sent) as client:
        await LoraSync(WeightPushConfig(), ADAPTER, str(tmp_path / "unused")).push([client], str(adapter), 1)
        await LoraSync(WeightPushConfig(), ADAPTER, str(tmp_path / "unused")).push([client], str(adapter), 2)
    assert [path for path, _ in sent] == [*STRUCTS, "/continue_generation"] * 2
    try:
        for path, body in sent:
            if path in STRUCTS:
                check_body(STRUCTS[path], body)
    except FileNotFoundError:
        pytest.skip("sglang 0.5.23 wheel not in the cache (only api_types.py is)")
    # The proxy's /generate body (one adapter) and a batch's (one per input) pass sglang's own decoder.
    proxied = GenerateRequest(input_ids=PROMPT, lora_path=ADAPTER)
    sglang_api_types.decode_GenerateRequest(msgspec.json.decode(encode_generate_body(proxied, stream=False)))
    sglang_api_types.decode_GenerateRequest({"input_ids": [PROMPT, PROMPT], "lora_path": [ADAPTER, None]})


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # the database is not the point
async def test_the_proxy_serves_through_the_adapter_and_records_its_logprobs(
    db_url: str, engine_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = perturbed_adapter(tiny_model_dir, tmp_path / "ckpt", 1, seed=1)
    async with SGLangClient(engine_url, ClientConfig()) as client:
        await LoraSync(WeightPushConfig(), ADAPTER, str(tmp_path / "unused")).push([client], str(adapter), 1)
    with lora_proxy(db_url, tiny_model_dir, engine_url, ADAPTER) as proxy:
        completion = await proxy.async_client().completions.create(
            model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=3
        )
        recorded = proxy.completion(completion.id)
    assert list(recorded.prompt_ids) == PROMPT
    assert set(recorded.output_versions.tolist()) == {1}
    output = (recorded.output_ids.tolist(), recorded.output_logprobs.tolist())
    lora_policy, base_policy = _policies(tiny_model_dir, adapter)
    assert recomputation_gap(lora_policy, PROMPT, *output) < TOLERANCE
    assert recomputation_gap(base_policy, PROMPT, *output) > 100 * TOLERANCE


TARGET = frozenset(range(300, 364))  # test_trainer_learning.py's task: 64 of the ~1,030 token ids
PROMPTS = [[11, 42, 97, 300], [64, 3, 250, 9, 17], [500, 501, 502], [7, 8, 900, 901, 12, 40]]
STEPS = 10
GROUP_SIZE = 8
MAX_NEW_TOKENS = 16
WINDOW = 3  # steps averaged at each end
MARGIN = 0.3  # the last steps' mean reward must beat the first steps' by this much (absolute)


# The tiny random model's logits are bounded by its small (frozen) embeddings, which lm_head shares:
# adapters on the attention and MLP layers alone can barely move the target tokens' share of the
# probability, while one on lm_head moves it within a few steps. So the output projection gets one too.
TARGET_MODULES = (*LORA_TARGET_MODULES, "lm_head")


def target_fraction(output: Sequence[int]) -> float:
    return sum(token in TARGET for token in output) / max(len(output), 1)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # learning is not about the database
async def test_a_lora_run_learns_the_dense_reward_with_adapter_checkpoints(
    session_factory: SessionFactory, engine_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    kl = KLConfig(coef=1e-3)
    config = TrainerConfig.model_validate({
        "batch_size": len(PROMPTS) * GROUP_SIZE, "lr": 5e-2, "num_threads": 1, "seed": 0,
        "keep_checkpoints": 2, "lora": {"target_modules": TARGET_MODULES}, "algorithm": {"loss": {"kl": kl}},
    })
    serving = ServingConfig(model=str(tiny_model_dir), lora_adapter=ADAPTER)
    checkpoints = tmp_path / "ckpt"
    policy = start_policy(str(tiny_model_dir), config)
    rewards: list[float] = []
    try:
        async with WorkerPool(ClientConfig(), [engine_url]) as pool:
            sync = await lora_sync(config, serving, policy, checkpoints, pool.clients)
            assert (await pool.clients[0].model_info())["weight_version"] == "default"
            async with AdapterClient(engine_url, ClientConfig(), ADAPTER) as sampler:
                for step in range(STEPS):
                    groups = [
                        await rollout_group(
                            sampler, session_factory, prompt, group_size=GROUP_SIZE,
                            max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, reward_fn=target_fraction,
                            seed=1000 * step + i,
                        )
                        for i, prompt in enumerate(PROMPTS)
                    ]
                    assert all(g.min_version == step for g in groups)  # sampled by the adapter just pushed
                    rewards.append(statistics.fmean(r for g in groups for r in g.rewards))
                    one_step = config.model_copy(update={"total_steps": step + 1})
                    driver = Driver(
                        one_step, session_factory, policy, pool.clients, checkpoints,
                        Monitor(tmp_path / "metrics.jsonl"), sync=sync,
                    )
                    assert await driver.run() == step + 1
    finally:
        policy.kill()
    print(f"reward per step: {[round(r, 3) for r in rewards]}")
    first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
    assert last >= first + MARGIN, f"reward {first:.3f} -> {last:.3f}: {rewards}"

    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS
    # The engine (frozen base + pushed adapter) and the trainer agree on every sampled token: the trainer
    # trained the adapter alone, and every version reached the engine.
    assert max(m["prox_behave/max_abs_diff"] for m in metrics) < TOLERANCE
    # The KL reference is the base model (adapter off): nil at the first step, where B = 0, then not.
    assert metrics[0]["kl/ref"] == 0.0 and metrics[-1]["kl/ref"] > 0.0

    kept = list_checkpoints(checkpoints)
    assert sorted(kept) == [STEPS - 1, STEPS]
    newest = kept[STEPS]
    assert {p.name for p in newest.iterdir() if p.is_file()} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    adapter_bytes = (newest / ADAPTER_WEIGHTS).stat().st_size
    model_bytes = (tiny_model_dir / SAFETENSORS_FILE).stat().st_size
    print(f"adapter checkpoint: {adapter_bytes} bytes; the model's weights: {model_bytes} bytes")
    assert adapter_bytes < model_bytes / 5
