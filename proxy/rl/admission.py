"""Admission control of the RL API (docs/architecture.md, "Admission control"), AReaL's capacity rule:
a new session is admitted only while

    admitted + joining ≤ (η + v + 1) · B

where `admitted` counts the sessions the RL API admitted that hold a slot (running, or ended with
trainable trajectories, consumed or not: storage/admission.py), `joining` is 1 for a session and n
for a group of n, v is the newest policy version, B `trainer.batch_size` and η
`trainer.max_head_offpolicyness` (`proxy.admission` may set its own). The unit is the session: one
counts once however many calls, choices (`n`) or branches it makes. Each training step adds B to the
capacity, so generation stays at most η + 1 batches ahead of training. A refusal is a 429 in OpenAI's
shape with `Retry-After` and `retry-after-ms`, which the `openai` client waits out by itself; nothing is
written. Online keys' traffic never passes here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from proxy.config import AdmissionConfig
from proxy.errors import OpenAIError
from proxy.metrics import ProxyMetrics
from proxy.rate_limits import rate_limited
from storage.admission import AdmissionRefused, AdmissionState, Admits


def capacity(version: int, batch_size: int, max_head_offpolicyness: int) -> int:
    """(η + v + 1) · B: the sessions the RL API may have admitted, in all, at policy version `version`."""
    return (max_head_offpolicyness + max(version, 0) + 1) * batch_size


def admits(admitted: int, joining: int, limit: int) -> bool:
    """Whether `joining` more sessions fit beside the `admitted` ones within `limit`."""
    return admitted + joining <= limit


@dataclass(frozen=True, slots=True)
class AdmissionRule:
    """The rule with its B and η, and the wait a refusal asks for."""

    batch_size: int
    max_head_offpolicyness: int
    retry_after_s: float

    @classmethod
    def of(cls, config: AdmissionConfig) -> AdmissionRule | None:
        """The configured rule; None when admission control is off."""
        if not config.enabled or config.batch_size is None or config.max_head_offpolicyness is None:
            return None
        return cls(config.batch_size, config.max_head_offpolicyness, config.retry_after_s)

    def capacity(self, version: int) -> int:
        return capacity(version, self.batch_size, self.max_head_offpolicyness)

    def admits(self, state: AdmissionState, joining: int) -> bool:
        return admits(state.admitted, joining, self.capacity(state.version))


def admission_gate(config: AdmissionConfig, metrics: ProxyMetrics) -> Admits | None:
    """The check storage runs in the transaction that creates the sessions (None: admission is off); it
    also sets the admitted and capacity gauges."""
    rule = AdmissionRule.of(config)
    if rule is None:
        return None

    def gate(state: AdmissionState, joining: int) -> bool:
        admitted = rule.admits(state, joining)
        metrics.admission_capacity.set(rule.capacity(state.version))
        metrics.admission_admitted.set(state.admitted + joining if admitted else state.admitted)
        return admitted

    return gate


def admission_refusal(
    config: AdmissionConfig, metrics: ProxyMetrics, refused: AdmissionRefused, kind: str
) -> OpenAIError:
    """The 429 for a refused creation of a `kind` ("session" or "group"), counted."""
    metrics.admission_refused.labels(kind).inc()
    rule = AdmissionRule.of(config)
    assert rule is not None, "only an enabled admission refuses"
    state, joining = refused.state, refused.joining
    limit = rule.capacity(state.version)
    wait = rule.retry_after_s
    what = "a session" if joining == 1 else f"{joining} sessions"
    message = (
        f"Admission control: {state.admitted} RL sessions hold a slot and {what} more would pass the "
        f"capacity of {limit} = (η {rule.max_head_offpolicyness} + policy version {state.version} + 1) × "
        f"batch {rule.batch_size}; each training step adds {rule.batch_size}. Retry after {wait:g} s."
    )
    headers = {
        "retry-after-ms": str(math.ceil(wait * 1000)),
        "x-ratelimit-limit-sessions": str(limit),
        "x-ratelimit-remaining-sessions": str(max(limit - state.admitted, 0)),
    }
    return rate_limited(message, wait, headers)


@contextmanager
def admission_control(config: AdmissionConfig, metrics: ProxyMetrics, kind: str) -> Iterator[Admits | None]:
    """The gate of one creation of a `kind` ("session" or "group") to hand to storage; a refusal inside
    becomes its 429."""
    try:
        yield admission_gate(config, metrics)
    except AdmissionRefused as refused:
        raise admission_refusal(config, metrics, refused, kind) from None
