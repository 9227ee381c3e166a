"""The proxy's router in front of several scripted SGLang workers, on SQLite and Postgres: sticky routing by
session, new sessions to the least busy worker, health checks taking a worker out of rotation and back,
and a worker killed mid-request (non-streaming and streaming, with the real `openai` client): the client
gets one complete answer from the other worker and exactly one recorded completion, token-exact."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.support.proxy_harness import LoopThread, Proxy, ProxyFactory
from tests.support.scripted_worker import ScriptedWorker, default_token_fn, token_text

MESSAGES = [{"role": "user", "content": "Count with me."}]


def scripted_text(output_ids: list[int]) -> str:
    return "".join(token_text(t) for t in output_ids)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def metric(proxy: Proxy, name: str, labels: str) -> float | None:
    text = httpx.get(f"{proxy.base_url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def leased(proxy: Proxy, worker: ScriptedWorker) -> float | None:
    """Requests the proxy counts as running on `worker`."""
    return metric(proxy, "flywheel_proxy_worker_in_flight", f'worker="{worker.url}"')


def generate_calls(worker: ScriptedWorker) -> list[Any]:
    return [r.body for r in worker.requests_to("/generate")]


def session_client(proxy: Proxy) -> Any:
    """A client on a new session of its own."""
    _session_id, key = proxy.new_session_key()
    return proxy.client(key=key)


def set_paused(servers: LoopThread, worker: ScriptedWorker, mode: str | None) -> None:
    async def apply() -> None:
        worker.set_paused(mode)

    servers.call(apply())


def test_sticky_by_session_and_new_sessions_to_the_least_busy(
    proxies: ProxyFactory, servers: LoopThread
) -> None:
    first, second = servers.start_scripted(), servers.start_scripted()
    proxy = proxies.start([first.url, second.url], sticky_slack=0)
    sticky = session_client(proxy)
    for _ in range(3):  # round-robin would alternate; the session stays where its prefix is cached
        sticky.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    home, other = (first, second) if generate_calls(first) else (second, first)
    assert len(generate_calls(home)) == 3 and not generate_calls(other)

    set_paused(servers, home, "in_place")  # holds the next request: home has one in flight
    held: list[Any] = []
    thread = threading.Thread(target=lambda: held.append(
        sticky.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)))
    thread.start()
    wait_for(lambda: home.in_flight == 1, "the held request")
    for _ in range(2):  # new sessions go to the least busy worker
        session_client(proxy).chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert len(generate_calls(other)) == 2
    # Its worker is now one request busier than the least busy: beyond a slack of 0, it moves.
    sticky.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert len(generate_calls(other)) == 3
    set_paused(servers, home, None)
    thread.join(30)
    assert held and held[0].choices[0].finish_reason == "length"
    assert len(generate_calls(home)) == 4
    assert metric(proxy, "flywheel_proxy_sticky_routing_total", 'result="hit"') == 3
    assert metric(proxy, "flywheel_proxy_sticky_routing_total", 'result="miss"') == 1
    assert proxy.count_completions() == 7
    for worker in (first, second):
        servers.call(worker.stop())


def test_health_checks_take_a_worker_out_and_back(proxies: ProxyFactory, servers: LoopThread) -> None:
    first, second = servers.start_scripted(), servers.start_scripted()
    proxy = proxies.start([first.url, second.url], health_check_interval_s=0.05)
    client = proxy.client(key=proxy.admin_key)  # a new session per call: only balancing decides
    up = 'worker="{}"'
    first.healthy = False
    wait_for(lambda: metric(proxy, "flywheel_proxy_worker_up", up.format(first.url)) == 0, "first out")
    for _ in range(4):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert not generate_calls(first) and len(generate_calls(second)) == 4

    first.healthy = True
    wait_for(lambda: metric(proxy, "flywheel_proxy_worker_up", up.format(first.url)) == 1, "first back")
    for _ in range(4):
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert len(generate_calls(first)) == 2 and len(generate_calls(second)) == 6

    first.healthy = second.healthy = False  # nobody up: requests are still tried (a paused SGLang
    wait_for(lambda: metric(proxy, "flywheel_proxy_worker_up", up.format(second.url)) == 0, "none up")
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)  # may fail health checks)
    assert proxy.count_completions() == 9
    for worker in (first, second):
        servers.call(worker.stop())


def expected_tokens(prompt_ids: list[int], count: int, seed: int = 0) -> list[int]:
    return [default_token_fn(prompt_ids, position, 0, seed) for position in range(count)]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_worker_killed_mid_request_finishes_on_another(
    proxies: ProxyFactory, servers: LoopThread, stream: bool
) -> None:
    doomed = servers.start_scripted(weight_version="1")
    survivor = servers.start_scripted(weight_version="2")
    doomed.crash_after_tokens = 4
    proxy = proxies.start([doomed.url, survivor.url])  # a new session's first call goes to the first
    client = proxy.client()
    if stream:
        chunks = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12,
                                                     stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        response_id = chunks[0].id
    else:
        response = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=12)
        text, finish, response_id = response.choices[0].message.content or "", [], response.id
        finish = [response.choices[0].finish_reason]
    assert doomed.dead and finish == ["length"]

    [killed] = generate_calls(doomed)
    [finished] = generate_calls(survivor)
    prompt = killed["input_ids"]
    rows = proxy.completions()
    assert len(rows) == 1 and rows[0].id == response_id  # one request, one completion: no orphans
    row = rows[0]
    assert row.prompt_ids.tolist() == prompt and row.finish_reason == "length"
    if stream:  # the survivor continued from what the client had already received
        partial = expected_tokens(prompt, 4)
        assert finished["input_ids"] == prompt + partial
        assert finished["sampling_params"]["max_new_tokens"] == 8
        output_ids = partial + expected_tokens(prompt + partial, 8)
        versions = [1] * 4 + [2] * 8
    else:  # nothing reached the client: the request is issued again, whole
        assert finished["input_ids"] == prompt and finished["sampling_params"]["max_new_tokens"] == 12
        output_ids = expected_tokens(prompt, 12)
        versions = [2] * 12
    assert row.output_ids.tolist() == output_ids
    assert row.output_versions.tolist() == versions
    assert len(row.output_logprobs) == 12
    assert text == scripted_text(output_ids)
    assert metric(proxy, "flywheel_proxy_worker_up", f'worker="{doomed.url}"') == 0
    for worker in (doomed, survivor):
        wait_for(lambda: leased(proxy, worker) == 0, "the leases to end")  # noqa: B023
    for worker in (doomed, survivor):
        servers.call(worker.stop())


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_worker_answering_5xx_is_left_for_another(
    proxies: ProxyFactory, servers: LoopThread, stream: bool
) -> None:
    failing, healthy = servers.start_scripted(), servers.start_scripted()
    failing.generate_status = 503
    proxy = proxies.start([failing.url, healthy.url])
    client = proxy.client()
    created = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=5, stream=stream)
    if stream:
        chunks = list(created)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        response_id = chunks[0].id
    else:
        text, response_id = created.choices[0].message.content or "", created.id
    assert len(generate_calls(failing)) == 1 and len(generate_calls(healthy)) == 1
    row = proxy.completion(response_id)
    assert proxy.count_completions() == 1 and text == scripted_text(row.output_ids.tolist())
    assert metric(proxy, "flywheel_proxy_worker_up", f'worker="{failing.url}"') == 0
    only_failing = proxies.start([failing.url])  # no other worker: the client sees the worker's error
    with pytest.raises(openai.InternalServerError) as error:
        only_failing.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=5)
    assert error.value.status_code == 502 and "the worker is failing" in error.value.message
    for worker in (failing, healthy):
        servers.call(worker.stop())


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_pause_abort_is_resumed_per_choice(proxies: ProxyFactory, servers: LoopThread, stream: bool) -> None:
    worker = servers.start_scripted(token_delay_s=0.01)
    proxy = proxies.start([worker.url])
    outcome: list[Any] = []

    def call() -> None:
        created = proxy.client().chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=40, n=2, stream=stream, seed=3)
        if stream:
            texts = ["", ""]
            for chunk in created:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
            outcome.append((chunk.id, texts))
        else:
            outcome.append((created.id, [c.message.content for c in created.choices]))

    thread = threading.Thread(target=call)
    thread.start()
    wait_for(lambda: worker.in_flight == 2 and len(worker._in_flight and next(
        iter(worker._in_flight.values())).output_ids) >= 5, "tokens generated")
    set_paused(servers, worker, "abort")

    async def push() -> None:
        worker.weight_version = "1"
        worker.set_paused(None)

    servers.call(push())
    thread.join(60)
    response_id, texts = outcome[0]
    rows = {row.id: row for row in proxy.completions()}
    assert set(rows) == {response_id, f"{response_id}-1"}
    first_call, *resumed = generate_calls(worker)
    assert len(resumed) == 2 and all(r["sampling_params"].get("n") is None for r in resumed)
    for index, completion_id in enumerate((response_id, f"{response_id}-1")):
        row = rows[completion_id]
        versions = row.output_versions.tolist()
        assert len(versions) == 40 and row.finish_reason == "length"
        boundary = versions.index(1)
        assert 0 < boundary and versions == [0] * boundary + [1] * (40 - boundary)
        output_ids = row.output_ids.tolist()
        piece = next(r for r in resumed if r["rid"].startswith(f"{completion_id}-resume"))
        prompt = first_call["input_ids"]
        assert piece["input_ids"] == prompt + output_ids[:boundary]
        assert piece["sampling_params"]["max_new_tokens"] == 40 - boundary
        seed = first_call["sampling_params"]["sampling_seed"]
        assert output_ids[:boundary] == [default_token_fn(prompt, p, index, seed) for p in range(boundary)]
        assert output_ids[boundary:] == [default_token_fn(piece["input_ids"], p, 0, seed)
                                         for p in range(40 - boundary)]
        assert texts[index] == scripted_text(output_ids)
    wait_for(lambda: leased(proxy, worker) == 0, "the leases to end")
    servers.call(worker.stop())


def test_an_abort_the_proxy_caused_is_recorded_not_resumed(
    proxies: ProxyFactory, servers: LoopThread
) -> None:
    worker = servers.start_scripted(token_delay_s=0.01)
    proxy = proxies.start([worker.url])
    stream = proxy.client().chat.completions.create(model="m", messages=MESSAGES, max_tokens=500, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()  # the client hangs up: the proxy aborts the request on the worker
    wait_for(lambda: proxy.count_completions() == 1, "the partial completion")
    assert proxy.completion(chunk.id).finish_reason == "abort"
    wait_for(lambda: worker.in_flight == 0, "the worker to stop")
    assert len(generate_calls(worker)) == 1 and worker.requests_to("/abort_request")
    assert metric(proxy, "flywheel_proxy_generation_resumes_total", 'cause="abort"') is None
    servers.call(worker.stop())


def test_a_stop_string_across_a_pause_ends_the_stream(proxies: ProxyFactory, servers: LoopThread) -> None:
    worker = servers.start_scripted()
    proxy = proxies.start([worker.url])
    client = proxy.client(key=proxy.admin_key)  # each call its own session: the same prompt ids
    client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=1)
    prompt = generate_calls(worker)[0]["input_ids"]
    before = expected_tokens(prompt, 6)  # generated before the pause
    after = expected_tokens(prompt + before, 30)  # by the resumed request
    stop = scripted_text(before[4:] + after[:2])  # the resumed request's worker sees only its half
    assert scripted_text(before + after).find(stop) == 4
    worker.pause_after_tokens = 6
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(list(client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=30, stop=[stop], stream=True))))
    thread.start()
    wait_for(lambda: worker.paused_mode == "abort" and len(generate_calls(worker)) == 3, "the resumed call")
    worker.pause_after_tokens = None
    set_paused(servers, worker, None)
    thread.join(30)
    chunks = outcome[0]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == scripted_text(before[:4])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    row = proxy.completion(chunks[0].id)
    assert row.finish_reason == "stop" and row.output_ids.tolist() == before + after[:2]
    assert generate_calls(worker)[2]["input_ids"] == prompt + before
    wait_for(lambda: worker.in_flight == 0, "the resumed request to be aborted")
    servers.call(worker.stop())


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_legacy_completions_resume_across_a_pause(
    proxies: ProxyFactory, servers: LoopThread, stream: bool
) -> None:
    worker = servers.start_scripted()
    worker.pause_after_tokens = 5
    proxy = proxies.start([worker.url])
    outcome: list[Any] = []

    def call() -> None:
        client = proxy.client()
        created = client.completions.create(model="m", prompt=[11, 12, 13], max_tokens=20, stream=stream)
        if stream:
            chunks = list(created)
            outcome.append((chunks[0].id, "".join(c.choices[0].text for c in chunks if c.choices)))
        else:
            outcome.append((created.id, created.choices[0].text))

    thread = threading.Thread(target=call)
    thread.start()
    wait_for(lambda: worker.paused_mode == "abort" and len(generate_calls(worker)) == 2, "the resumed call")

    async def push() -> None:
        worker.pause_after_tokens = None
        worker.weight_version = "1"
        worker.set_paused(None)

    servers.call(push())
    thread.join(30)
    response_id, text = outcome[0]
    [row] = proxy.completions()
    before = expected_tokens([11, 12, 13], 5)
    output_ids = before + expected_tokens([11, 12, 13, *before], 15)
    assert row.id == response_id and row.output_ids.tolist() == output_ids and row.finish_reason == "length"
    assert row.output_versions.tolist() == [0] * 5 + [1] * 15
    assert text == scripted_text(output_ids)
    servers.call(worker.stop())
