"""The arithmetic of per-key limits (proxy/rate_limits.py): token buckets, a key's own limits over its
kind's, the reset of daily quotas, and the 429 a key over its rate gets."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from proxy.config import KeyRateLimit
from proxy.errors import OpenAIError
from proxy.rate_limits import (
    Bucket,
    RequestRates,
    effective_limit,
    refill,
    seconds_to_midnight,
    wait_for_token,
)
from storage.keys import KeyLimits


def test_a_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = Bucket(tokens=0.0, updated=10.0)
    refill(bucket, rate=2.0, burst=3.0, now=10.25)
    assert bucket.tokens == pytest.approx(0.5) and wait_for_token(bucket, 2.0) == pytest.approx(0.25)
    refill(bucket, rate=2.0, burst=3.0, now=20.0)
    assert bucket.tokens == 3.0 and wait_for_token(bucket, 2.0) == 0.0


def test_a_keys_own_limits_replace_its_kinds() -> None:
    defaults = KeyRateLimit(requests_per_s=50, burst=100)
    assert effective_limit(defaults, KeyLimits()) is defaults
    own = effective_limit(defaults, KeyLimits(requests_per_s=None, burst=5, tokens_per_day=1000))
    assert own == KeyRateLimit(requests_per_s=50, burst=5, tokens_per_day=1000)


def test_daily_quotas_reset_at_midnight_utc() -> None:
    assert seconds_to_midnight(datetime(2026, 12, 1, 23, 59, 30, tzinfo=UTC)) == 30.0
    assert seconds_to_midnight(datetime(2026, 12, 1, 0, 0, tzinfo=UTC)) == 86400.0


def test_a_key_past_its_burst_gets_429_with_retry_after_and_rate_limit_headers() -> None:
    rates = RequestRates()
    limit = KeyRateLimit(requests_per_s=0.5, burst=2)
    rates.take(1, limit)
    rates.take(1, limit)
    rates.take(2, limit)  # another key has its own bucket
    with pytest.raises(OpenAIError) as refused:
        rates.take(1, limit)
    error = refused.value
    assert error.status == 429 and error.type == "rate_limit_error"
    assert int(error.headers["Retry-After"]) >= 1
    assert error.headers["x-ratelimit-limit-requests"] == "2"
    assert error.headers["x-ratelimit-remaining-requests"] == "0"
    rates.take(1, KeyRateLimit())  # no rate: never refused
