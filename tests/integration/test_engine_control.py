"""Weight updates, pause/continue, aborts and the info routes of the CPU engine, on a real server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from serving.models.loading import load_model
from tests.support.engine_server import (
    PROMPT,
    assert_logprobs_match,
    conforms,
    generate,
    reference_logits,
    running_engine,
    wait_until,
)

LONG = 600
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def original_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def perturbed(tiny_model_dir, tmp_path_factory):
    """A perturbed copy of the tiny model, saved as a safetensors checkpoint: (directory, model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    out = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(out)
    return out, model


def model_info(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/model_info").json()


def stats(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/server_info").json()["internal_states"][0]


def update(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/update_weights_from_disk", json=body, timeout=60)


class Stream:
    """A streamed /generate consumed in the background; `chunks` fills as data arrives."""

    def __init__(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.task = asyncio.create_task(self._consume(client, {**body, "stream": True}))

    async def _consume(self, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
        async with client.stream("POST", "/generate", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    self.chunks.append(json.loads(line[len("data: "):]))

    @property
    def tokens(self) -> int:
        return len(self.chunks[-1]["output_ids"]) if self.chunks else 0


def test_weight_update_changes_outputs_version_and_logprobs(tiny_model_dir, perturbed, sglang_api_types):
    directory, new_model = perturbed
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, **GREEDY}, "return_logprob": True}
    with running_engine(tiny_model_dir) as url:
        before = generate(url, body)
        answer = update(url, {"model_path": str(directory), "weight_version": "v2", "flush_cache": True})
        assert answer.status_code == 200
        message = "Succeeded to update model weights. Weight version updated to v2."
        assert answer.json() == {"success": True, "message": message, "num_paused_requests": 0}
        info = model_info(url)
        sglang_api_types.decode_GetModelInfoResponse(info)
        assert info["weight_version"] == "v2" and info["model_path"] == str(directory)
        after = generate(url, body)
        assert after["output_ids"] != before["output_ids"]
        assert after["meta_info"]["weight_version"] == "v2"
        logits = assert_logprobs_match(new_model, PROMPT, after, temperature=1.0)
        assert after["output_ids"] == logits.argmax(dim=-1).tolist()


def broken_checkpoints(tmp_path: Path, tiny_model_dir: Path) -> dict[str, Path]:
    from safetensors.torch import load_file

    tensors = load_file(tiny_model_dir / "model.safetensors")
    missing = tmp_path / "missing"
    missing.mkdir()
    save_file({k: v for k, v in tensors.items() if "layers.0.mlp" not in k}, missing / "model.safetensors")
    wrong_shape = tmp_path / "wrong-shape"
    wrong_shape.mkdir()
    resized = dict(tensors)
    resized["model.norm.weight"] = torch.ones(7)
    save_file(resized, wrong_shape / "model.safetensors")
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"not a checkpoint")
    return {"absent": tmp_path / "nowhere", "missing": missing, "wrong-shape": wrong_shape,
            "garbage": garbage, "empty": tmp_path}


def test_bad_weight_update_is_refused_and_old_weights_keep_serving(tiny_model_dir, tmp_path):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, **GREEDY}, "return_logprob": True}
    with running_engine(tiny_model_dir) as url:
        before = generate(url, body)
        for name, path in broken_checkpoints(tmp_path, tiny_model_dir).items():
            answer = update(url, {"model_path": str(path), "weight_version": f"bad-{name}"})
            assert answer.status_code == 400, name
            assert answer.json()["success"] is False and answer.json()["message"], name
            assert model_info(url)["weight_version"] == "default"
            again = generate(url, body)
            assert again["output_ids"] == before["output_ids"], name
            assert again["meta_info"]["output_token_logprobs"] == before["meta_info"]["output_token_logprobs"]


async def test_in_place_pause_holds_requests_until_continue(tiny_model_dir):
    with running_engine(tiny_model_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            long = {"max_new_tokens": LONG, **GREEDY}
            stream = Stream(client, {"input_ids": PROMPT, "sampling_params": long})
            await wait_until(lambda: stream.tokens > 0)
            paused = await client.post("/pause_generation", json={"mode": "in_place"})
            assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
            await asyncio.sleep(0.1)
            held_at, steps = stream.tokens, stats(url)["decode_steps"]
            newcomer = asyncio.create_task(client.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}))
            await asyncio.sleep(0.4)
            assert stream.tokens == held_at < LONG
            assert stats(url)["decode_steps"] == steps and not newcomer.done()
            resumed = await client.post("/continue_generation", json={})
            assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
            await stream.task
            final = stream.chunks[-1]
            assert final["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
            assert (await newcomer).json()["meta_info"]["completion_tokens"] == 4
            alone = await client.post("/generate", json={"input_ids": PROMPT, "sampling_params": long})
            assert alone.json()["output_ids"] == final["output_ids"]


async def test_abort_pause_ends_requests_with_partial_output(tiny_model_dir, sglang_api_types):
    with running_engine(tiny_model_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1500, **GREEDY},
                    "return_logprob": True}
            running = asyncio.create_task(client.post("/generate", json=body))
            await wait_until(lambda: stats(url)["decode_steps"] > 5)
            await client.post("/pause_generation", content=b"")  # an empty body means mode=abort
            answer = await running
            assert answer.status_code == 200
            result = answer.json()
            conforms(sglang_api_types, body, result)
            meta = result["meta_info"]
            assert meta["finish_reason"]["type"] == "abort"
            assert 0 < meta["completion_tokens"] == len(result["output_ids"]) < 1500
            assert len(meta["output_token_logprobs"]) == len(result["output_ids"])
            newcomer = asyncio.create_task(client.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}}))
            await asyncio.sleep(0.3)
            assert not newcomer.done()  # paused: new requests wait, they are not aborted
            await client.post("/continue_generation", json={})
            assert (await newcomer).json()["meta_info"]["finish_reason"] == {"type": "length", "length": 4}


async def test_retract_and_update_while_paused_records_weight_version_spans(
        tiny_model_dir, perturbed, original_model):
    directory, new_model = perturbed
    with running_engine(tiny_model_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            stream = Stream(client, {"input_ids": PROMPT, "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": LONG, **GREEDY}})
            await wait_until(lambda: stream.tokens > 0)
            await client.post("/pause_generation", json={"mode": "retract"})
            swap = await client.post("/update_weights_from_disk", json={"model_path": str(directory),
                                                                        "weight_version": "v2"})
            assert swap.json()["success"] is True  # paused: no waiting for the held request
            await client.post("/continue_generation", json={})
            await stream.task
    final = stream.chunks[-1]
    meta = final["meta_info"]
    assert meta["num_retractions"] == 1 and meta["weight_version"] == "v2"
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "v2"]
    switch = spans[0]["end"]
    assert spans == [{"version": "default", "start": 0, "end": switch},
                     {"version": "v2", "start": switch, "end": LONG}] and 0 < switch < LONG
    output = final["output_ids"]
    old = reference_logits(original_model, PROMPT, output).argmax(dim=-1).tolist()
    new = reference_logits(new_model, PROMPT, output).argmax(dim=-1).tolist()
    assert output[:switch] == old[:switch]  # made by the old weights
    assert output[switch:] == new[switch:]  # re-prefilled and continued on the new ones


async def test_update_without_pause_waits_for_running_requests(tiny_model_dir, perturbed):
    directory, _ = perturbed
    with running_engine(tiny_model_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": LONG, **GREEDY}}
            running = asyncio.create_task(client.post("/generate", json=body))
            await wait_until(lambda: stats(url)["decode_steps"] > 5)
            swap = asyncio.create_task(client.post("/update_weights_from_disk", json={
                "model_path": str(directory), "weight_version": "v2"}))
            result = (await running).json()
            assert result["meta_info"]["finish_reason"] == {"type": "length", "length": LONG}
            assert result["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": LONG}]
            assert (await swap).json()["success"] is True
            # With abort_all_requests the update does not wait: the running request is cut short.
            running = asyncio.create_task(client.post("/generate", json={**body, "sampling_params": {
                "max_new_tokens": 1500, **GREEDY}}))
            await wait_until(lambda: stats(url)["running_requests"] == 1)
            swap = await client.post("/update_weights_from_disk", json={
                "model_path": str(directory), "weight_version": "v3", "abort_all_requests": True})
            assert swap.json()["success"] is True
            assert (await running).json()["meta_info"]["finish_reason"]["type"] == "abort"
            assert model_info(url)["weight_version"] == "v3"


async def test_abort_request_by_rid_and_all(tiny_model_dir, sglang_api_types):
    with running_engine(tiny_model_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            def long(rid: str) -> Any:
                return asyncio.create_task(client.post("/generate", json={
                    "input_ids": PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 1500, **GREEDY}}))
            victim, bystander = long("victim"), long("bystander")
            await wait_until(lambda: stats(url)["running_requests"] == 2)
            assert (await client.post("/flush_cache")).status_code == 400  # SGLang refuses while busy
            body = {"rid": "victim"}
            sglang_api_types.decode_AbortRequest(body)
            assert (await client.post("/abort_request", json=body)).status_code == 200
            victim_meta = (await victim).json()["meta_info"]
            assert victim_meta["id"] == "victim" and victim_meta["finish_reason"]["type"] == "abort"
            assert not bystander.done()
            await client.post("/abort_request", json={"abort_all": True})
            assert (await bystander).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_requests_of_clients_that_hang_up_are_aborted(tiny_model_dir):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2000, **GREEDY}}
    with running_engine(tiny_model_dir) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            stream = Stream(client, body)
            await wait_until(lambda: stream.tokens > 0)
            stream.task.cancel()  # the streaming client goes away
            await wait_until(lambda: stats(url)["running_requests"] == 0)
            first = stats(url)["generated_tokens"]
            assert first < 2000
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as impatient:
            with pytest.raises(httpx.ReadTimeout):  # a plain client gives up waiting
                await impatient.post("/generate", json=body)
        await wait_until(lambda: stats(url)["running_requests"] == 0)
        assert stats(url)["generated_tokens"] - first < 2000


def test_a_failing_step_aborts_its_batch_and_the_engine_keeps_serving(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir))
    forward = loaded.model.forward
    broken = {"now": False}

    def flaky_forward(*args: Any, **kwargs: Any) -> Any:
        if broken["now"]:
            raise RuntimeError("simulated kernel failure")
        return forward(*args, **kwargs)
    loaded.model.forward = flaky_forward
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, **GREEDY}}
    with running_engine(tiny_model_dir, loaded) as url:
        healthy = generate(url, body)
        broken["now"] = True
        failed = generate(url, body)["meta_info"]["finish_reason"]
        assert failed["type"] == "abort" and "simulated kernel failure" in failed["message"]
        broken["now"] = False
        assert generate(url, body)["output_ids"] == healthy["output_ids"]


def test_info_and_health_routes(tiny_model_dir, sglang_api_types):
    with running_engine(tiny_model_dir, max_batch_size=4) as url:
        info = model_info(url)
        sglang_api_types.decode_GetModelInfoResponse(info)
        assert info["is_generation"] is True and info["weight_version"] == "default"
        assert httpx.get(f"{url}/get_model_info").json() == info
        server = httpx.get(f"{url}/get_server_info").json()
        sglang_api_types.decode_GetServerInfoResponse(server)
        assert server["max_context_length"] == 2048 and server["max_running_requests"] == 4
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/health_generate", timeout=30).status_code == 200
        assert httpx.post(f"{url}/flush_cache").status_code == 200
        version = httpx.post(f"{url}/update_weight_version", json={"new_version": "7"}).json()
        assert version == {"success": True, "message": "Weight version updated to 7", "new_version": "7"}
        assert generate(url, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})[
            "meta_info"]["weight_version"] == "7"
        metrics = httpx.get(f"{url}/metrics").text
        assert "flywheel_engine_decode_steps_total" in metrics
        assert 'flywheel_engine_finished_requests_total{reason="length"}' in metrics
