"""Continuous batching: concurrent requests with different parameters decode together in one batch, and
each gets exactly what it gets alone."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.support.engine_server import PROMPT, running_engine, wait_until

REQUESTS = 16


def request_bodies() -> list[dict[str, Any]]:
    """16 requests that differ in prompt, length, temperature, truncation, stops and logprobs."""
    bodies = []
    for i in range(REQUESTS):
        prompt = PROMPT[: 2 + i % 5] + [100 + 7 * i] * (i % 3)  # prompts of 2 to 8 tokens
        params: dict[str, Any] = {"max_new_tokens": 20 + 3 * i}
        if i % 4 == 0:
            params |= {"temperature": 0.0}
        elif i % 4 == 1:
            params |= {"temperature": 0.0, "stop_token_ids": [733, 459], "ignore_eos": i % 8 == 1}
        elif i % 4 == 2:
            params |= {"temperature": 0.8, "top_p": 0.9, "sampling_seed": i}
        else:
            params |= {"temperature": 1.2, "top_k": 20, "min_p": 0.01, "sampling_seed": 100 + i}
        bodies.append({"input_ids": prompt, "sampling_params": params, "return_logprob": i % 2 == 0,
                       "rid": f"req-{i}"})
    return bodies


async def run_all(client: httpx.AsyncClient, bodies: list[dict[str, Any]], stagger_s: float) -> list[Any]:
    async def one(i: int, body: dict[str, Any]) -> Any:
        await asyncio.sleep(i * stagger_s)
        answer = await client.post("/generate", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()
    return await asyncio.gather(*(one(i, body) for i, body in enumerate(bodies)))


def assert_same(together: dict[str, Any], alone: dict[str, Any]) -> None:
    assert together["output_ids"] == alone["output_ids"]
    assert together["text"] == alone["text"]
    assert together["meta_info"]["finish_reason"] == alone["meta_info"]["finish_reason"]
    if "output_token_logprobs" in alone["meta_info"]:
        got = [entry[0] for entry in together["meta_info"]["output_token_logprobs"]]
        want = [entry[0] for entry in alone["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)


def server_stats(client_url: str) -> dict[str, Any]:
    return httpx.get(f"{client_url}/server_info").json()["internal_states"][0]


async def test_concurrent_requests_batch_together_and_match_running_alone(tiny_model_dir):
    bodies = request_bodies()
    with running_engine(tiny_model_dir, max_batch_size=REQUESTS) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            alone = [await run_all(client, [body], 0.0) for body in bodies]
            assert server_stats(url)["max_batch_size_observed"] == 1
            # Staggered arrivals: requests join a batch that is already decoding, and leave it early.
            staggered = await run_all(client, bodies, stagger_s=0.004)
            for together, (single,) in zip(staggered, alone, strict=True):
                assert_same(together, single)
            assert server_stats(url)["max_batch_size_observed"] > 1
            # All held back by a pause, then admitted at once: one prefill, one batch of 16.
            await client.post("/pause_generation", json={"mode": "in_place"})
            held = asyncio.gather(*(client.post("/generate", json=body) for body in bodies))
            await wait_until(lambda: server_stats(url)["waiting_requests"] == REQUESTS)
            await client.post("/continue_generation", json={})
            together = [answer.json() for answer in await held]
            for answer, (single,) in zip(together, alone, strict=True):
                assert_same(answer, single)
            assert server_stats(url)["max_batch_size_observed"] == REQUESTS
            metrics = (await client.get("/metrics")).text
            assert f"flywheel_engine_max_batch_size_observed {float(REQUESTS)}" in metrics


async def test_more_requests_than_the_batch_wait_their_turn(tiny_model_dir):
    bodies = request_bodies()[:6]
    with running_engine(tiny_model_dir, max_batch_size=2) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            alone = [await run_all(client, [body], 0.0) for body in bodies]
            together = await run_all(client, bodies, stagger_s=0.0)
            for answer, (single,) in zip(together, alone, strict=True):
                assert_same(answer, single)
            assert server_stats(url)["max_batch_size_observed"] == 2
