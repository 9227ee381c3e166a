"""The CPU engine on a loopback port for tests, and checks of its /generate answers: logprobs against the
model's own fp32 logits, SGLang 0.5.23's schema."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch

from serving.config import CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import LoadedModel, load_model

PROMPT = [74, 75, 536, 300, 12, 99]  # token ids of the tiny model's vocabulary


@contextmanager
def running_engine(model_dir: Path, loaded: LoadedModel | None = None, **cpu: Any) -> Iterator[str]:
    """A CPU engine on a loopback port serving `loaded`, or a fresh copy of the model in `model_dir`."""
    config = ServingConfig(model=str(model_dir), cpu=CpuEngineConfig(num_threads=1, **cpu))
    with serve_in_thread(create_engine_app(config, loaded or load_model(str(model_dir)))) as url:
        yield url


def generate(url: str, body: dict[str, Any], status: int = 200) -> Any:
    """POST /generate, expecting `status`; the JSON answer."""
    answer = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    return answer.json()


def reference_logits(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """fp32 logits that chose each output token: (len(output_ids), V)."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return logits[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]


def assert_logprobs_match(model, prompt_ids, answer, temperature: float) -> torch.Tensor:
    output_ids = answer["output_ids"]
    logits = reference_logits(model, prompt_ids, output_ids)
    expected = torch.log_softmax(logits / temperature, dim=-1)[torch.arange(len(output_ids)), output_ids]
    reported = answer["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in reported] == output_ids
    assert torch.allclose(torch.tensor([entry[0] for entry in reported]), expected, atol=1e-4)
    return logits


def conforms(api_types, body: dict[str, Any], answer: Any) -> None:
    """Our request decodes with SGLang's request decoder and our answer with its response decoder."""
    api_types.decode_GenerateRequest(body)
    for item in answer if isinstance(answer, list) else [answer]:
        decoded = api_types.decode_GenerateResponse(item)
        assert decoded.meta_info is not None and decoded.meta_info.id


async def wait_until(predicate, timeout_s: float = 30.0) -> None:
    """Poll `predicate` on the running loop until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)
