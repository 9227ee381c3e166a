"""The proxy in front of the real CPU engine serving the tiny model (both on real uvicorn servers), on
SQLite and Postgres: the `openai` client's answers are recorded with token ids whose detokenisation is
the returned text, logprobs equal to the model's at the sampling temperature, and per-token versions."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.config import CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import load_model
from tests.support.proxy_harness import Proxy, ProxyFactory

MESSAGES = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": [{"type": "text", "text": "12 + 30 ="}]},
]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    config = ServingConfig(model=str(tiny_model_dir), cpu=CpuEngineConfig(num_threads=1))
    with serve_in_thread(create_engine_app(config, load_model(str(tiny_model_dir)))) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def proxy(proxies: ProxyFactory, engine_url: str) -> Proxy:
    return proxies.start([engine_url])


def model_logprobs(
    model: Any, prompt_ids: list[int], output_ids: list[int], temperature: float
) -> list[float]:
    """log p(token) of each output token under an fp32 forward, at the sampling temperature."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    chosen = logits[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]
    logprobs = torch.log_softmax(chosen / temperature, dim=-1)[torch.arange(len(output_ids)), output_ids]
    return logprobs.tolist()


def assert_token_exact(row: Any, text: str, tokenizer: Any, model: Any, temperature: float) -> None:
    output_ids = row.output_ids.tolist()
    assert tokenizer.decode(output_ids, skip_special_tokens=True) == text
    expected = model_logprobs(model, row.prompt_ids.tolist(), output_ids, temperature)
    assert row.output_logprobs.tolist() == pytest.approx(expected, abs=1e-4)
    assert row.output_versions.tolist() == [0] * len(output_ids)


def test_non_stream_n2_with_logprobs(proxy: Proxy, tokenizer: Any, reference_model: Any) -> None:
    response = proxy.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, n=2, logprobs=True, top_logprobs=2,
        temperature=0.8, seed=7,
    )
    flat = [MESSAGES[0], {"role": "user", "content": "12 + 30 ="}]
    prompt = tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=True)
    for choice in response.choices:
        completion_id = choice.model_extra["completion_id"]  # type: ignore[index]
        assert completion_id == (response.id if choice.index == 0 else f"{response.id}-{choice.index}")
        row = proxy.completion(completion_id)
        assert tokenizer.decode(row.prompt_ids.tolist()) == prompt
        assert_token_exact(row, choice.message.content or "", tokenizer, reference_model, 0.8)
        assert choice.logprobs is not None and choice.logprobs.content is not None
        served = [entry.logprob for entry in choice.logprobs.content]
        assert served == pytest.approx(row.output_logprobs.tolist(), abs=1e-6)
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        joined = b"".join(bytes(entry.bytes or ()) for entry in choice.logprobs.content)
        # A random model emits bytes that are not always valid UTF-8; both sides replace them alike.
        decoded = tokenizer.decode(row.output_ids.tolist(), skip_special_tokens=False)
        assert joined.decode("utf-8", errors="replace") == decoded


def test_stream_with_usage(proxy: Proxy, tokenizer: Any, reference_model: Any) -> None:
    stream = proxy.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    row = proxy.completion(chunks[0].id)
    assert_token_exact(row, content, tokenizer, reference_model, 1.0)
    assert row.response_json["choices"][0]["message"]["content"] == content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(row.output_ids)


async def test_async_stream_n2(proxy: Proxy, tokenizer: Any, reference_model: Any) -> None:
    client = proxy.async_client()
    stream = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, n=2, stream=True, temperature=0.6,
    )
    texts = ["", ""]
    response_id = ""
    async for chunk in stream:
        response_id = chunk.id
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    await client.close()
    for index, text in enumerate(texts):
        row = proxy.completion(response_id if index == 0 else f"{response_id}-{index}")
        assert_token_exact(row, text, tokenizer, reference_model, 0.6)


def test_dropped_stream_is_recorded_as_abort(proxy: Proxy, tokenizer: Any, reference_model: Any) -> None:
    # EOS is banned: sampled at temperature 1, the tiny model can end the answer before the client
    # leaves (one CI run recorded "stop"), and then there is nothing left to abort.
    eos = {tokenizer.eos_token_id, reference_model.config.eos_token_id} - {None}
    stream = proxy.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1500, stream=True, temperature=1.0,
        logit_bias={str(token): -100 for token in eos}, extra_body={"min_p": 0.0},
    )
    received = ""
    for chunk in stream:
        received += chunk.choices[0].delta.content or ""
        if len(received) >= 4:
            break
    stream.close()
    deadline = time.monotonic() + 30
    row = None
    while row is None and time.monotonic() < deadline:
        row = next((c for c in proxy.completions() if c.id == chunk.id), None)
        time.sleep(0.05)
    assert row is not None and row.finish_reason == "abort"
    assert 0 < len(row.output_ids) < 1500
    assert tokenizer.decode(row.output_ids.tolist(), skip_special_tokens=True).startswith(received)


def test_new_weight_version_reaches_the_record(proxy: Proxy, engine_url: str) -> None:
    answer = httpx.post(f"{engine_url}/update_weight_version", json={"new_version": "4"}, timeout=30)
    assert answer.status_code == 200, answer.text
    try:
        response = proxy.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5)
        row = proxy.completion(response.id)
        assert row.output_versions.tolist() == [4] * len(row.output_ids)
    finally:
        httpx.post(f"{engine_url}/update_weight_version", json={"new_version": "default"}, timeout=30)
