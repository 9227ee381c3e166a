"""Admission control's pure parts: AReaL's capacity rule at its boundary, the 429 it answers in OpenAI's
shape, where B and η come from in the config, and how the GSM8K agent's RLClient reads a 429's wait."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from flywheel.config import load_config
from integrations.gsm8k.rl_api import MAX_RETRY_AFTER_S, retry_after_s
from proxy.config import AdmissionConfig, ProxyConfig
from proxy.errors import OpenAIError
from proxy.metrics import ProxyMetrics
from proxy.rl.admission import AdmissionRule, admission_control, admission_gate, admits, capacity
from storage.admission import AdmissionRefused, AdmissionState

ON = AdmissionConfig(enabled=True, batch_size=4, max_head_offpolicyness=1, retry_after_s=0.25)


@pytest.mark.parametrize(
    ("version", "batch", "eta", "expected"),
    [(0, 4, 0, 4), (0, 4, 1, 8), (3, 4, 2, 24), (10, 1, 0, 11)],
)
def test_capacity_is_eta_plus_version_plus_one_batches(
    version: int, batch: int, eta: int, expected: int
) -> None:
    assert capacity(version, batch, eta) == expected


def test_admits_up_to_the_capacity_line_and_a_group_counts_its_size() -> None:
    assert admits(admitted=7, joining=1, limit=8)
    assert not admits(admitted=8, joining=1, limit=8)
    assert admits(admitted=6, joining=2, limit=8)
    assert not admits(admitted=7, joining=2, limit=8)  # a group is admitted whole or not at all


def test_the_rule_reads_the_newest_version() -> None:
    rule = AdmissionRule.of(ON)
    assert rule is not None
    assert rule.admits(AdmissionState(admitted=7, version=0), 1)
    assert not rule.admits(AdmissionState(admitted=8, version=0), 1)
    assert rule.admits(AdmissionState(admitted=8, version=1), 4)  # a step adds B
    assert AdmissionRule.of(AdmissionConfig()) is None  # off by default


def test_gate_sets_the_gauges() -> None:
    metrics = ProxyMetrics()
    gate = admission_gate(ON, metrics)
    assert gate is not None and admission_gate(AdmissionConfig(), metrics) is None
    assert gate(AdmissionState(admitted=5, version=2), 2)
    assert metrics.admission_capacity._value.get() == 16
    assert metrics.admission_admitted._value.get() == 7


def test_refusal_is_a_429_in_openai_shape_with_retry_after() -> None:
    metrics = ProxyMetrics()
    with pytest.raises(OpenAIError) as refused, admission_control(ON, metrics, "group"):
        raise AdmissionRefused(AdmissionState(admitted=7, version=0), 2)
    error = refused.value
    assert error.status == 429
    body = json.loads(json.dumps(error.body()))
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
    assert "capacity of 8" in body["error"]["message"]
    assert error.headers["Retry-After"] == "1"  # whole seconds, rounded up
    assert error.headers["retry-after-ms"] == "250"
    assert error.headers["x-ratelimit-limit-sessions"] == "8"
    assert error.headers["x-ratelimit-remaining-sessions"] == "1"
    assert metrics.admission_refused.labels("group")._value.get() == 1


def test_b_and_eta_follow_the_trainer_unless_set() -> None:
    config = load_config(None, ["trainer.batch_size=6", "trainer.max_head_offpolicyness=2",
                                "proxy.admission.enabled=true"])
    assert (config.proxy.admission.batch_size, config.proxy.admission.max_head_offpolicyness) == (6, 2)
    own = load_config(None, ["trainer.batch_size=6", "proxy.admission.batch_size=3"])
    assert (own.proxy.admission.batch_size, own.proxy.admission.max_head_offpolicyness) == (3, 0)
    with pytest.raises(ValidationError, match=r"proxy\.admission\.batch_size"):
        ProxyConfig(admission={"enabled": True})  # on its own, the proxy does not know the trainer's


def _answer(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, headers=headers, json={"error": {"message": "no"}})


def test_rl_client_reads_the_wait_of_a_429() -> None:
    assert retry_after_s(_answer(429, **{"retry-after-ms": "250", "Retry-After": "1"})) == 0.25
    assert retry_after_s(_answer(429, **{"Retry-After": "3"})) == 3.0
    assert retry_after_s(_answer(429, **{"Retry-After": "86400"})) == MAX_RETRY_AFTER_S
    assert retry_after_s(_answer(429)) is None  # says nothing: not retried
    assert retry_after_s(_answer(503, **{"Retry-After": "1"})) is None
