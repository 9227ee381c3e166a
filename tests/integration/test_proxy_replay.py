"""Replay of real agent requests (OpenClaw, hermes-agent) captured on loopback: every chat completion
request they sent is accepted by the proxy (200, a complete stream or object) and recorded, and every
model probe (hermes-agent's LM Studio, Ollama and OpenAI ones) is answered in the shape the agent reads.

The captures are tests/fixtures/agent-requests/*.jsonl; its README says where they come from.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory
from tests.support.scripted_worker import default_token_fn

EOS = 2  # the tiny tokenizer's <|im_end|>
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
PROBES = ("/v1/models", "/api/v1/models", "/api/show")
CONTEXT_LENGTH = 1 << 20  # the replay proxy's
CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "agent-requests"
CAPTURE_FILES = ("hermes-agent.jsonl", "openclaw-chat.jsonl", "openclaw-tool-roundtrip.jsonl")


def _captured() -> list[Any]:
    """One case per captured request; a missing capture file fails the collection."""
    return [
        pytest.param(json.loads(line), id=f"{Path(name).stem}:{number}")
        for name in CAPTURE_FILES
        for number, line in enumerate((CAPTURES / name).read_text().splitlines(), 1)
        if line.strip()
    ]


def _stop_after_a_few(prompt_ids: Sequence[int], position: int, index: int, seed: int) -> int:
    return EOS if position >= 6 else default_token_fn(prompt_ids, position, index, seed)


@pytest.fixture
def replay_proxy(proxies: ProxyFactory, servers: LoopThread) -> Proxy:
    worker = servers.start_scripted(token_fn=_stop_after_a_few, eos_token_id=EOS, record=False)
    # The captured prompts are far longer than the tiny model's context; the scripted worker has none.
    return proxies.start([worker.url], context_length=CONTEXT_LENGTH, default_max_tokens=64)


@pytest.mark.parametrize("captured", _captured())
def test_captured_agent_request_is_accepted(replay_proxy: Proxy, captured: dict[str, Any]) -> None:
    method, path = captured["method"], captured["path"]
    assert path in CHAT_PATHS or path in PROBES or path.startswith("/v1/models/"), (
        f"{method} {path}: no replay check for this route"
    )
    headers = {"Authorization": f"Bearer {replay_proxy.session_key}"}
    url = f"{replay_proxy.base_url}{path}"
    if path not in CHAT_PATHS:
        _assert_probe_answered(replay_proxy, method, path, captured["body"])
        return
    body = captured["body"]
    before = replay_proxy.count_completions()
    if body.get("stream"):
        _assert_complete_stream(url, headers, body)
    else:
        response = httpx.post(url, headers=headers, json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["object"] == "chat.completion"
    assert replay_proxy.count_completions() == before + max(1, body.get("n") or 1)


def _assert_complete_stream(url: str, headers: dict[str, str], body: dict[str, Any]) -> None:
    with httpx.stream("POST", url, headers=headers, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read().decode()
        events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    finished = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    finished = [reason for reason in finished if reason]
    assert finished == ["stop"]
    if (body.get("stream_options") or {}).get("include_usage"):
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7


def _assert_probe_answered(proxy: Proxy, method: str, path: str, body: Any) -> None:
    """Each probe answered as hermes-agent 0.19.0 reads it (agent/model_metadata.py): for the served
    model, the context length the proxy enforces; for the captured name (not served), the 404 of that
    API, on which hermes moves on to its next probe."""
    headers = {"Authorization": f"Bearer {proxy.session_key}"}
    listing = httpx.get(f"{proxy.v1}/models", headers=headers, timeout=30)
    assert listing.status_code == 200, listing.text
    served = listing.json()["data"][0]
    assert served["max_model_len"] == CONTEXT_LENGTH and served["owned_by"] == "flywheel"
    name = served["id"]
    response = httpx.request(method, f"{proxy.base_url}{path}", headers=headers, json=body, timeout=30)
    if path == "/v1/models":
        assert response.json() == listing.json()
    elif path == "/api/v1/models":  # detect_local_server_type, fetch_endpoint_model_metadata
        assert response.status_code == 200, response.text
        (model,) = response.json()["models"]
        assert model["key"] == name and model["type"] == "llm"
        assert model["loaded_instances"][0]["config"]["context_length"] == CONTEXT_LENGTH
        assert model["max_context_length"] == CONTEXT_LENGTH
    elif path == "/api/show":  # _query_ollama_api_show: any non-200 is "unknown", never an error
        assert body["name"] != name
        assert response.status_code == 404 and "error" in response.json()
        served_body = {**body, "name": name}
        shown = httpx.post(f"{proxy.base_url}{path}", headers=headers, json=served_body, timeout=30)
        assert shown.status_code == 200, shown.text
        info = shown.json()["model_info"]
        assert [v for k, v in info.items() if "context_length" in k] == [CONTEXT_LENGTH]
        assert shown.json()["parameters"] == f"num_ctx {CONTEXT_LENGTH}"
    else:  # /v1/models/{id}, _query_local_context_length: a 404 sends hermes on to /v1/models
        assert path.startswith("/v1/models/") and path != f"/v1/models/{name}"
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
        retrieved = httpx.get(f"{proxy.v1}/models/{name}", headers=headers, timeout=30)
        assert retrieved.status_code == 200 and retrieved.json() == served
