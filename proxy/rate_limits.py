"""Rate limits and token quotas per API key, so one client cannot take the proxy (or the budget) from
the others.

- Requests per second, with a burst: a token bucket per key, in this proxy's memory (several proxies
  each allow the rate: the bound is per replica).
- Tokens per day (prompt + completion, UTC days), for keys that have a quota: counted in the database
  (`key_usage`), so several proxies agree. Each proxy adds what it served to the database every
  `flush_interval_s` (one upsert per key, off the request path) and reads the day's totals back; a key
  over its quota is refused until the next UTC midnight. Between flushes the proxies may together
  overshoot by what they served in one interval.

A limit comes from the key itself when set (`api_keys.requests_per_s`, `burst`, `tokens_per_day`: see
`flywheel keys create --help`), else from the defaults of its kind (`proxy.rate_limits`). Feedback
calls (`POST /rl/v1/feedback`) have a token bucket per key of their own, `proxy.rate_limits.feedback`
for every kind of key. A refusal is a 429 with `Retry-After` and OpenAI's `x-ratelimit-*` headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from proxy.auth import Principal
from proxy.config import KeyRateLimit, RateLimitsConfig
from proxy.errors import OpenAIError
from storage.engine import SessionFactory
from storage.keys import KeyLimits
from storage.usage import add_key_usage, key_usage_on

_LIMITS_CACHED = 4096  # (key kind, own limits) pairs whose effective limits are kept

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Bucket:
    """A token bucket: `tokens` left (at most the burst) as of `updated` (monotonic seconds)."""

    tokens: float
    updated: float


def refill(bucket: Bucket, rate: float, burst: float, now: float) -> None:
    """Add what `rate` tokens per second earned since the bucket's last update, up to `burst`."""
    bucket.tokens = min(burst, bucket.tokens + (now - bucket.updated) * rate)
    bucket.updated = now


def wait_for_token(bucket: Bucket, rate: float) -> float:
    """Seconds until the bucket holds one whole token again (0 if it does)."""
    return 0.0 if bucket.tokens >= 1 else (1 - bucket.tokens) / rate


def effective_limit(defaults: KeyRateLimit, own: KeyLimits) -> KeyRateLimit:
    """A key's limits: its own where it has them, its kind's defaults for the rest."""
    update = {name: value for name in ("requests_per_s", "burst", "tokens_per_day")
              if (value := getattr(own, name)) is not None}
    return defaults.model_copy(update=update) if update else defaults


def seconds_to_midnight(now: datetime) -> float:
    """Seconds until the next UTC day starts (when a daily quota resets)."""
    tomorrow = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), tzinfo=UTC)
    return (tomorrow - now).total_seconds()


def rate_limited(message: str, retry_after_s: float, headers: dict[str, str]) -> OpenAIError:
    """A 429 the openai client waits out (it honours Retry-After) before retrying."""
    seconds = max(1, math.ceil(retry_after_s))
    return OpenAIError(429, message, "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(seconds), **headers})


class RequestRates:
    """Requests per second per key: a token bucket each (least recently used forgotten past
    `max_keys`; a forgotten key starts again with a full burst)."""

    def __init__(self, max_keys: int = 100_000) -> None:
        self._buckets: dict[int, Bucket] = {}
        self._max_keys = max_keys

    def take(self, key_id: int, limit: KeyRateLimit, what: str = "requests") -> None:
        """Spend one request of the key's rate; 429 when none is left (its message counts `what`)."""
        rate = limit.requests_per_s
        if rate is None:
            return
        burst = float(limit.burst if limit.burst is not None else max(1, math.ceil(rate)))
        now = time.monotonic()
        bucket = self._buckets.pop(key_id, None) or Bucket(burst, now)
        self._buckets[key_id] = bucket  # newest last: the oldest go first
        if len(self._buckets) > self._max_keys:
            del self._buckets[next(iter(self._buckets))]
        refill(bucket, rate, burst, now)
        wait = wait_for_token(bucket, rate)
        if wait > 0:
            headers = {"x-ratelimit-limit-requests": str(int(burst)), "x-ratelimit-remaining-requests": "0",
                       "x-ratelimit-reset-requests": f"{wait:.3f}s"}
            raise rate_limited(f"Rate limit reached: {rate:g} {what} per second for this API key (burst "
                               f"{int(burst)}). Retry after {wait:.2f} s.", wait, headers)
        bucket.tokens -= 1


class DailyTokens:
    """Tokens served per key and UTC day, as the database and this proxy's unflushed count know them."""

    def __init__(self, session_factory: SessionFactory, flush_interval_s: float) -> None:
        self._session_factory = session_factory
        self._flush_interval_s = flush_interval_s
        self._day = datetime.now(UTC).date()
        self._known: dict[int, int] = {}  # the database's totals for today, as of the last flush
        self._pending: dict[int, int] = {}  # served here, not yet in the database

    def check(self, key_id: int, limit: KeyRateLimit) -> None:
        """429 (until midnight UTC) when the key has used its tokens for the day."""
        quota = limit.tokens_per_day
        if quota is None:
            return
        self._roll_over()
        used = self._known.get(key_id, 0) + self._pending.get(key_id, 0)
        if used >= quota:
            reset = seconds_to_midnight(datetime.now(UTC))
            headers = {"x-ratelimit-limit-tokens": str(quota), "x-ratelimit-remaining-tokens": "0",
                       "x-ratelimit-reset-tokens": f"{reset:.0f}s"}
            raise rate_limited(f"Token quota reached: {quota} tokens per day for this API key (used "
                               f"{used}); it resets at midnight UTC.", reset, headers)

    def add(self, key_id: int, tokens: int) -> None:
        """Count tokens served to the key (flushed to the database later)."""
        self._roll_over()
        self._pending[key_id] = self._pending.get(key_id, 0) + tokens

    def _roll_over(self) -> None:
        today = datetime.now(UTC).date()
        if today != self._day:
            self._day, self._known = today, {}

    async def flush(self) -> None:
        """Add what was served here to the database, and read the day's totals back."""
        pending, self._pending = self._pending, {}
        day: date = self._day
        try:
            if pending:
                await add_key_usage(self._session_factory, day, pending)
            totals = await key_usage_on(self._session_factory, day, set(self._known) | set(pending))
        except Exception as exc:  # an outage: keep the counts and try at the next interval
            for key, tokens in pending.items():
                self._pending[key] = self._pending.get(key, 0) + tokens
            logger.warning("could not flush token usage (%s: %s); retrying", type(exc).__name__, exc)
            return
        if day == self._day:
            self._known.update(totals)

    @contextlib.asynccontextmanager
    async def flushing(self) -> AsyncIterator[None]:
        """Flush every `flush_interval_s` while the block runs, and once more at its end."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(self._flush_interval_s)
                await self.flush()

        task = asyncio.create_task(loop(), name="token-usage-flush")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.flush()


class KeyLimiter:
    """The limits of every key: `admit` before a call's work, `count` what it served once recorded;
    `admit_feedback` before a feedback call (a bucket of its own)."""

    def __init__(self, config: RateLimitsConfig, session_factory: SessionFactory) -> None:
        self._config = config
        self._limits: dict[tuple[str, float | None, int | None, int | None], KeyRateLimit] = {}
        self.rates = RequestRates()
        self.feedback_rates = RequestRates()
        self.tokens = DailyTokens(session_factory, config.flush_interval_s)

    def admit_feedback(self, principal: Principal) -> None:
        """429 if the caller's key is over its feedback rate (`proxy.rate_limits.feedback`); else the call
        is counted. Inference calls never spend this bucket, nor feedback calls theirs."""
        if principal.key_id is not None:
            self.feedback_rates.take(principal.key_id, self._config.feedback, "feedback calls")

    def admit(self, principal: Principal) -> None:
        """429 if the caller's key is over its rate or its daily tokens; else the call is counted."""
        key_id = principal.key_id
        if key_id is not None:
            limit = self._limit(principal)
            self.tokens.check(key_id, limit)
            self.rates.take(key_id, limit)

    def counter(self, principal: Principal) -> Callable[[int], None] | None:
        """What counts the tokens (prompt + completion) a call of the caller's key was served; None for a
        key without a daily quota (every session key, by default): nothing to count, no database rows."""
        key_id = principal.key_id
        if key_id is None or self._limit(principal).tokens_per_day is None:
            return None
        return functools.partial(self.tokens.add, key_id)

    def _limit(self, principal: Principal) -> KeyRateLimit:
        own = principal.limits
        # Keyed by plain values, hashed and compared in C (a KeyLimits key is hashed in Python per call).
        key = (principal.scope, own.requests_per_s, own.burst, own.tokens_per_day)
        found = self._limits.get(key)
        if found is None:  # few distinct (kind, own limits) pairs: computed once each, not per call
            found = effective_limit(self._config.of(principal.scope), own)
            if len(self._limits) >= _LIMITS_CACHED:
                self._limits.clear()
            self._limits[key] = found
        return found
