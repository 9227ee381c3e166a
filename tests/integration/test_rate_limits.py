"""Per-key rate limits and daily token quotas, end to end on SQLite and Postgres: a key over its rate gets
429 with Retry-After (the openai client's RateLimitError), a key over its tokens of the day is refused
until midnight UTC by every proxy on the database, and other keys are untouched."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from sqlalchemy import select

from proxy.auth import create_online_key
from storage.engine import SessionFactory
from storage.keys import KeyLimits
from storage.models import KeyUsage
from tests.support.databases import key_hasher
from tests.support.proxy_harness import ProxyFactory, run_db
from tests.support.scripted_worker import ScriptedWorker

MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(base_url: str, key: str) -> httpx.Response:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_a_session_key_over_its_rate_gets_429_with_retry_after(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    proxy = proxies.start([scripted.url], rate_limits={"session": {"requests_per_s": 0.2, "burst": 2}})
    answers = [_chat(proxy.base_url, proxy.session_key) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    refused = answers[2]
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    with pytest.raises(openai.RateLimitError):
        proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    _other, other_key = proxy.new_session_key()
    assert _chat(proxy.base_url, other_key).status_code == 200  # the limit is the key's own
    assert _chat(proxy.base_url, proxy.admin_key).status_code == 200  # admin keys: unlimited by default


def test_a_key_over_its_daily_tokens_is_refused_by_every_proxy_until_midnight(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    settings = {"rate_limits": {"flush_interval_s": 0.05}}
    first = proxies.start([scripted.url], **settings)
    hasher = key_hasher(first.db_url)
    key = run_db(first.db_url, lambda f: create_online_key(f, hasher, KeyLimits(tokens_per_day=40)))
    served = 0
    for _ in range(20):
        answer = _chat(first.base_url, key)
        if answer.status_code == 429:
            break
        assert answer.status_code == 200
        usage = answer.json()["usage"]
        served += usage["prompt_tokens"] + usage["completion_tokens"]
    else:
        pytest.fail("the quota never refused a call")
    assert served >= 40
    assert answer.headers["x-ratelimit-remaining-tokens"] == "0"
    assert 1 <= int(answer.headers["retry-after"]) <= 86400
    time.sleep(0.3)  # the first proxy's count reaches the database
    rows = run_db(first.db_url, _usage)
    assert sum(row.tokens for row in rows) == served
    second = proxies.start([scripted.url], **settings)
    assert _chat(second.base_url, key).status_code == 200  # it has not read the day's total yet
    time.sleep(0.3)
    assert _chat(second.base_url, key).status_code == 429  # now it has, from the database


async def _usage(factory: SessionFactory) -> list[KeyUsage]:
    async with factory() as db:
        return list((await db.execute(select(KeyUsage))).scalars())
