"""The model probes agents send before chatting (hermes-agent 0.19.0, agent/model_metadata.py), against
a real proxy over HTTP: LM Studio's `GET /api/v1/models`, Ollama's `POST /api/show` and OpenAI's
`GET /v1/models[/{id}]` all give the served model's name and the context length the proxy enforces."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.proxy_harness import Proxy, ProxyFactory
from tests.support.scripted_worker import ScriptedWorker

CONTEXT = 4096


@pytest.fixture
def probed(proxies: ProxyFactory, scripted: ScriptedWorker) -> Proxy:
    return proxies.start([scripted.url], context_length=CONTEXT, reasoning_parser="qwen3")


def _get(proxy: Proxy, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or proxy.session_key}"}
    return httpx.get(f"{proxy.base_url}{path}", headers=headers, timeout=30)


def _show(proxy: Proxy, body: Any, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key or proxy.session_key}"}
    return httpx.post(f"{proxy.base_url}/api/show", headers=headers, json=body, timeout=30)


def _served_name(proxy: Proxy) -> str:
    name: str = _get(proxy, "/v1/models").json()["data"][0]["id"]
    return name


def test_lmstudio_model_list_gives_the_served_model_and_its_context(probed: Proxy) -> None:
    response = _get(probed, "/api/v1/models")
    assert response.status_code == 200, response.text
    (model,) = response.json()["models"]
    name = _served_name(probed)
    # hermes: key (or id) names the model; loaded_instances[].config.context_length is its context.
    assert model["key"] == model["display_name"] == name
    assert model["type"] == "llm" and model["publisher"] == "flywheel"
    assert model["loaded_instances"] == [{"id": name, "config": {"context_length": CONTEXT}}]
    assert model["max_context_length"] == CONTEXT
    assert model["architecture"] == "qwen2"
    assert model["capabilities"] == {"vision": False, "trained_for_tool_use": True}


@pytest.mark.parametrize("field", ["model", "name"])
def test_ollama_show_gives_context_length_and_capabilities(probed: Proxy, field: str) -> None:
    response = _show(probed, {field: _served_name(probed)})
    assert response.status_code == 200, response.text
    shown = response.json()
    # hermes: any model_info key holding "context_length", else "num_ctx N" in parameters.
    assert shown["model_info"] == {"general.architecture": "qwen2", "qwen2.context_length": CONTEXT}
    assert shown["parameters"] == f"num_ctx {CONTEXT}"
    assert shown["capabilities"] == ["completion", "tools", "thinking"]  # no "vision": text only
    assert shown["details"]["family"] == "qwen2"


def test_ollama_show_refusals_are_ollama_shaped(probed: Proxy) -> None:
    unknown = _show(probed, {"name": "mock-model"})
    assert unknown.status_code == 404
    assert unknown.json() == {"error": "model 'mock-model' not found"}
    missing = _show(probed, {})
    assert missing.status_code == 400 and missing.json() == {"error": "model is required"}
    headers = {"Authorization": f"Bearer {probed.session_key}", "Content-Type": "application/json"}
    garbled = httpx.post(f"{probed.base_url}/api/show", headers=headers, content=b"{not json", timeout=30)
    assert garbled.status_code == 400 and "error" in garbled.json()


def test_capabilities_follow_the_configured_parsers(proxies: ProxyFactory, scripted: ScriptedWorker) -> None:
    plain = proxies.start([scripted.url], tool_call_parser="none")
    model = _get(plain, "/api/v1/models").json()["models"][0]
    assert model["capabilities"]["trained_for_tool_use"] is False
    # Without a configured context length: the model config's max_position_embeddings, everywhere.
    context = model["max_context_length"]
    assert context == _get(plain, "/v1/models").json()["data"][0]["max_model_len"]
    shown = _show(plain, {"model": model["key"]}).json()
    assert shown["capabilities"] == ["completion"]
    assert shown["model_info"]["qwen2.context_length"] == context


def test_openai_model_card_answers_the_served_id_and_404s_others(probed: Proxy) -> None:
    name = _served_name(probed)
    card = _get(probed, f"/v1/models/{name}")
    assert card.status_code == 200, card.text
    # hermes reads max_model_len (then context_length, max_tokens) from the card.
    assert card.json()["max_model_len"] == CONTEXT and card.json()["owned_by"] == "flywheel"
    unknown = _get(probed, "/v1/models/mock-model")
    assert unknown.status_code == 404  # hermes then falls back to the /v1/models list
    assert unknown.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("method,path", [("GET", "/api/v1/models"), ("POST", "/api/show")])
def test_probes_need_a_key(probed: Proxy, method: str, path: str) -> None:
    url = f"{probed.base_url}{path}"
    anonymous = httpx.request(method, url, json={"name": "x"}, timeout=30)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "authentication_error"
    wrong = httpx.request(
        method, url, json={"name": "x"}, headers={"Authorization": "Bearer sk-nope"}, timeout=30
    )
    assert wrong.status_code == 401
