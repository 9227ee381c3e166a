"""A weight push (the trainer's real `push_weights`) in the middle of a long generation, through the proxy
in front of the real CPU engine serving the tiny model, on SQLite and Postgres, streamed and not:

- pause mode `abort`: the engine ends the request with its partial output; the proxy resumes it as
  prompt + tokens so far on the new weights and stitches the pieces;
- pause mode `in_place`: the engine keeps the request and reports `weight_versions` spans.

Either way the client gets one complete response (max_tokens long: the end-of-sequence token is biased
away), and the recorded completion has per-token versions that change from 0 to 1 at one boundary, token
ids whose detokenisation is the text the client got, and logprobs equal to each version's model's (for
`abort` on both sides of the boundary: the resumed piece is prefilled on the new weights).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.client import WorkerPool
from serving.config import ClientConfig, CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import load_model
from tests.support.proxy_harness import ProxyFactory
from trainer.config import WeightPushConfig
from trainer.weights.disk import push_weights

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
MAX_TOKENS = 300
NO_EOS_BIAS = -100.0
TOKENS_BEFORE_PUSH = 12


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def models(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    """(version 0 model, version 1 model, version 1 checkpoint directory)."""
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    perturbed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in perturbed.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    checkpoint = tmp_path_factory.mktemp("version-1")
    perturbed.save_pretrained(checkpoint)
    return original, perturbed, checkpoint


@pytest.fixture
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """A fresh engine per test: each test changes its weights."""
    config = ServingConfig(model=str(tiny_model_dir), cpu=CpuEngineConfig(num_threads=1))
    with serve_in_thread(create_engine_app(config, load_model(str(tiny_model_dir)))) as url:
        yield url


def push(engine_url: str, checkpoint: Path, mode: str) -> None:
    async def run() -> None:
        async with WorkerPool(ClientConfig(), [engine_url]) as pool:
            await push_weights(pool.clients, str(checkpoint), 1, WeightPushConfig(pause_mode=mode))  # type: ignore[arg-type]

    asyncio.run(run())


def engine_state(engine_url: str) -> dict[str, Any]:
    return httpx.get(f"{engine_url}/server_info", timeout=10).json()["internal_states"][0]


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def model_logprobs(model: Any, prompt_ids: list[int], output_ids: list[int], eos_id: int) -> list[float]:
    """log p(token) of each output token under an fp32 forward at temperature 1, EOS biased as asked."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    chosen = logits[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]
    chosen[:, eos_id] += NO_EOS_BIAS
    logprobs = torch.log_softmax(chosen, dim=-1)[torch.arange(len(output_ids)), output_ids]
    return logprobs.tolist()


@pytest.mark.parametrize("mode", ["abort", "in_place"])
@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_weight_push_mid_generation(
    proxies: ProxyFactory, engine_url: str, tokenizer: Any, models: tuple[Any, Any, Path], mode: str,
    stream: bool,
) -> None:
    original, perturbed, checkpoint = models
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    proxy = proxies.start([engine_url])
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 1.0,
               "logit_bias": {str(eos_id): NO_EOS_BIAS}, "seed": 5}
    client = proxy.client()
    if stream:
        chunks = []
        for chunk in client.chat.completions.create(**request, stream=True):
            chunks.append(chunk)
            if len(chunks) == TOKENS_BEFORE_PUSH:  # the proxy keeps reading the engine meanwhile
                push(engine_url, checkpoint, mode)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        response_id = chunks[0].id
    else:
        base = engine_state(engine_url)["generated_tokens"]
        answers: list[Any] = []
        thread = threading.Thread(target=lambda: answers.append(client.chat.completions.create(**request)))
        thread.start()
        wait_for(lambda: engine_state(engine_url)["generated_tokens"] - base >= TOKENS_BEFORE_PUSH,
                 "the first tokens")
        push(engine_url, checkpoint, mode)
        thread.join(120)
        response = answers[0]
        text, finish = response.choices[0].message.content or "", [response.choices[0].finish_reason]
        response_id = response.id
    assert finish == ["length"]

    rows = proxy.completions()
    assert [row.id for row in rows] == [response_id]  # one request, one completion
    row = rows[0]
    prompt_ids, output_ids = row.prompt_ids.tolist(), row.output_ids.tolist()
    versions = row.output_versions.tolist()
    assert len(output_ids) == MAX_TOKENS and row.finish_reason == "length"
    boundary = versions.index(1) if 1 in versions else 0
    assert 0 < boundary and versions == [0] * boundary + [1] * (MAX_TOKENS - boundary)
    assert tokenizer.decode(output_ids, skip_special_tokens=True) == text
    recorded = row.output_logprobs.tolist()
    before = model_logprobs(original, prompt_ids, output_ids[:boundary], eos_id)
    assert recorded[:boundary] == pytest.approx(before, abs=1e-4)
    if mode == "abort":  # the resumed piece was prefilled, prompt + tokens so far, on the new weights
        after = model_logprobs(perturbed, prompt_ids, output_ids, eos_id)[boundary:]
        assert recorded[boundary:] == pytest.approx(after, abs=1e-4)
    resumes = httpx.get(f"{proxy.base_url}/metrics", timeout=10).text
    resumed = 'flywheel_proxy_generation_resumes_total{cause="abort"} 1.0' in resumes
    assert resumed == (mode == "abort")
