"""SGLangClient against the scripted SGLang worker on a real loopback port: every method, the retry
rule, error mapping, admin auth and SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from serving.client import (
    GenerateRequest,
    SamplingParams,
    SGLangClient,
    WorkerPool,
    iter_sse_data,
    make_session,
)
from serving.config import ClientConfig
from serving.errors import (
    WorkerBadRequest,
    WorkerConnectionError,
    WorkerHTTPError,
    WorkerProtocolError,
    WorkerTimeout,
)
from tests.support.scripted_worker import ScriptedWorker, eventually

FAST_RETRY = ClientConfig(max_retries=3, retry_backoff_s=0.001)


@pytest.fixture
async def worker() -> AsyncIterator[ScriptedWorker]:
    async with ScriptedWorker() as running:
        yield running


@pytest.fixture
async def client(worker: ScriptedWorker) -> AsyncIterator[SGLangClient]:
    async with SGLangClient(worker.url, FAST_RETRY) as sglang:
        yield sglang


def request(max_new_tokens: int = 6, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[11, 12, 13, 14],
        sampling_params=SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, **sampling),
        return_logprob=True,
        rid="req-1",
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def counting_session(config: ClientConfig) -> tuple[aiohttp.ClientSession, list[str]]:
    """A session whose trace hook records every attempt (each try of the retry loop is one)."""
    attempts: list[str] = []

    async def on_request_start(session: Any, context: Any, params: aiohttp.TraceRequestStartParams) -> None:
        attempts.append(params.url.path)

    trace = aiohttp.TraceConfig()
    trace.on_request_start.append(on_request_start)
    session = aiohttp.ClientSession(trace_configs=[trace])
    return session, attempts


# ---- generate -------------------------------------------------------------------------------------


async def test_generate_returns_sglang_answer(client: SGLangClient, worker: ScriptedWorker) -> None:
    answer = await client.generate(request(max_new_tokens=6))
    assert isinstance(answer, dict)
    meta = answer["meta_info"]
    assert len(answer["output_ids"]) == 6 == meta["completion_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["id"] == "req-1"
    assert meta["prompt_tokens"] == 4
    assert [entry[1] for entry in meta["output_token_logprobs"]] == answer["output_ids"]
    assert meta["weight_version"] == "default"
    # The body on the wire: set fields only, no nulls, no stream flag.
    assert worker.requests_to("/generate")[0].body == {
        "input_ids": [11, 12, 13, 14],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
        "rid": "req-1",
        "return_logprob": True,
    }


async def test_generate_accepts_a_plain_dict(client: SGLangClient) -> None:
    answer = await client.generate({"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert isinstance(answer, dict)
    assert answer["meta_info"]["prompt_tokens"] == 2
    assert len(answer["output_ids"]) == 3
    with pytest.raises(ValueError, match="generate_stream"):
        await client.generate({"text": "hi", "stream": True})


async def test_stream_chunks_are_cumulative_and_last_equals_non_stream(client: SGLangClient) -> None:
    full = await client.generate(request(max_new_tokens=5))
    chunks = [chunk async for chunk in client.generate_stream(request(max_new_tokens=5))]
    assert len(chunks) == 5
    for earlier, later in itertools.pairwise(chunks):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
        assert len(later["output_ids"]) == len(earlier["output_ids"]) + 1
        assert later["text"].startswith(earlier["text"])
        assert earlier["meta_info"]["finish_reason"] is None
    assert chunks[-1] == full


async def test_a_finished_stream_leaves_no_generator_to_the_loops_finalizer(client: SGLangClient) -> None:
    """An async generator dropped unfinished is closed by the loop's finalizer hook: a cross-thread
    wake-up and one more task per streamed request, on the proxy's hot path."""
    finalized: list[Any] = []
    hooks = sys.get_asyncgen_hooks()
    sys.set_asyncgen_hooks(hooks.firstiter, lambda agen: finalized.append(agen.__qualname__))
    try:
        for _ in range(3):
            async with contextlib.aclosing(client.generate_stream(request(max_new_tokens=4))) as stream:
                chunks = [chunk async for chunk in stream]
            assert chunks[-1]["meta_info"]["finish_reason"] is not None
        gc.collect()
    finally:
        sys.set_asyncgen_hooks(*hooks)
    assert finalized == []


async def test_n_greater_than_one_gives_a_list(client: SGLangClient) -> None:
    answers = await client.generate(request(max_new_tokens=4, n=3))
    assert isinstance(answers, list) and len(answers) == 3
    assert len({tuple(answer["output_ids"]) for answer in answers}) == 3

    streamed: dict[int, dict[str, Any]] = {}
    async for chunk in client.generate_stream(request(max_new_tokens=4, n=3)):
        streamed[chunk["index"]] = chunk
    assert sorted(streamed) == [0, 1, 2]
    for index, answer in enumerate(answers):
        assert streamed[index]["output_ids"] == answer["output_ids"]
        assert streamed[index]["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]


async def test_stop_token_ends_generation(client: SGLangClient) -> None:
    first = await client.generate(request(max_new_tokens=8))
    stop_at = first["output_ids"][2]
    stopped = await client.generate(request(max_new_tokens=8, stop_token_ids=[stop_at]))
    assert stopped["output_ids"] == first["output_ids"][:3]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


async def test_leaving_a_stream_early_closes_it_at_the_worker() -> None:
    async with ScriptedWorker(token_delay_s=0.005) as slow, SGLangClient(slow.url, FAST_RETRY) as client:
        async with contextlib.aclosing(client.generate_stream(request(max_new_tokens=10_000))) as stream:
            async for chunk in stream:
                if len(chunk["output_ids"]) == 3:
                    break
        await eventually(lambda: slow.in_flight == 0)


# ---- weights, pause, abort, flush ---------------------------------------------------------------


async def test_update_weights_from_disk_changes_the_version(
    client: SGLangClient, worker: ScriptedWorker
) -> None:
    result = await client.update_weights_from_disk("/ckpt/step-7", weight_version=7)
    assert result["success"] is True
    assert worker.requests_to("/update_weights_from_disk")[0].body == {
        "model_path": "/ckpt/step-7", "weight_version": "7", "flush_cache": True, "abort_all_requests": False,
    }
    info = await client.model_info()
    assert (info["model_path"], info["weight_version"]) == ("/ckpt/step-7", "7")
    answer = await client.generate(request())
    assert answer["meta_info"]["weight_version"] == "7"


async def test_failed_weight_load_raises_bad_request(client: SGLangClient, worker: ScriptedWorker) -> None:
    worker.weight_load_error = "Failed to load weights: no safetensors in /nope"
    with pytest.raises(WorkerBadRequest, match="no safetensors") as raised:
        await client.update_weights_from_disk("/nope", weight_version=1)
    assert raised.value.status == 400
    assert len(worker.requests_to("/update_weights_from_disk")) == 1


async def test_pause_holds_requests_until_continue(client: SGLangClient, worker: ScriptedWorker) -> None:
    paused = await client.pause_generation("retract")
    assert paused["status"] == "ok"
    assert worker.requests_to("/pause_generation")[0].body == {"mode": "retract"}
    pending = asyncio.create_task(client.generate(request(max_new_tokens=3)))
    await eventually(lambda: worker.in_flight == 1)
    await asyncio.sleep(0.05)
    assert not pending.done()  # a paused scheduler cannot answer
    with pytest.raises(WorkerBadRequest, match="Flush cache failed"):
        await client.flush_cache()
    await client.continue_generation()
    answer = await asyncio.wait_for(pending, 5)
    assert answer["meta_info"]["finish_reason"]["type"] == "length"
    assert worker.requests_to("/continue_generation")[0].body == {}
    await client.flush_cache()


async def test_pause_abort_returns_partial_output(client: SGLangClient, worker: ScriptedWorker) -> None:
    await client.pause_generation("in_place")
    pending = asyncio.create_task(client.generate(request(max_new_tokens=3)))
    await eventually(lambda: worker.in_flight == 1)
    await client.pause_generation("abort")
    answer = await asyncio.wait_for(pending, 5)
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    await client.continue_generation()
    with pytest.raises(ValueError):
        await client.pause_generation("stop")  # type: ignore[arg-type]


async def test_abort_request_by_rid_and_all(client: SGLangClient, worker: ScriptedWorker) -> None:
    await client.pause_generation("in_place")
    one = asyncio.create_task(client.generate(request()))
    other = asyncio.create_task(client.generate({"input_ids": [1], "rid": "other"}))
    await eventually(lambda: worker.in_flight == 2)
    await client.abort_request(rid="req-1")
    assert (await asyncio.wait_for(one, 5))["meta_info"]["finish_reason"]["type"] == "abort"
    assert not other.done()
    await client.abort_request(abort_all=True)
    assert (await asyncio.wait_for(other, 5))["meta_info"]["finish_reason"]["type"] == "abort"
    bodies = [r.body for r in worker.requests_to("/abort_request")]
    assert bodies == [{"rid": "req-1"}, {"abort_all": True}]
    with pytest.raises(ValueError):
        await client.abort_request()


# ---- information and health ---------------------------------------------------------------------


async def test_model_info(client: SGLangClient) -> None:
    info = await client.model_info()
    assert info["model_path"] == "scripted/model"
    assert info["weight_version"] == "default"


async def test_model_info_falls_back_to_get_model_info() -> None:
    async with ScriptedWorker(legacy_model_info=True) as old, SGLangClient(old.url, FAST_RETRY) as client:
        info = await client.model_info()
        assert info["model_path"] == "scripted/model"
        await client.model_info()
        assert [r.path for r in old.requests] == ["/model_info", "/get_model_info", "/get_model_info"]


async def test_health(client: SGLangClient, worker: ScriptedWorker) -> None:
    assert await client.health() is True
    assert await client.health_generate() is True
    worker.healthy = False
    assert await client.health() is False
    assert await client.health_generate() is False


async def test_wait_until_healthy(client: SGLangClient, worker: ScriptedWorker) -> None:
    worker.healthy = False
    with pytest.raises(WorkerTimeout, match="not healthy"):
        await client.wait_until_healthy(timeout_s=0.1, poll_interval_s=0.01)

    async def recover() -> None:
        await asyncio.sleep(0.05)
        worker.healthy = True

    recovering = asyncio.create_task(recover())
    await client.wait_until_healthy(timeout_s=5, poll_interval_s=0.01)
    await recovering
    assert worker.healthy


async def test_wait_until_healthy_on_a_closed_port_times_out() -> None:
    async with SGLangClient(f"http://127.0.0.1:{free_port()}", FAST_RETRY) as client:
        with pytest.raises(WorkerTimeout, match="cannot connect"):
            await client.wait_until_healthy(timeout_s=0.5, poll_interval_s=0.01)


# ---- retries and errors -------------------------------------------------------------------------


async def test_connection_refused_is_retried_then_raises() -> None:
    session, attempts = counting_session(FAST_RETRY)
    async with session:
        client = SGLangClient(f"http://127.0.0.1:{free_port()}", FAST_RETRY, session=session)
        with pytest.raises(WorkerConnectionError) as raised:
            await client.generate(request())
        assert raised.value.request_sent is False
        assert attempts == ["/generate"] * (1 + FAST_RETRY.max_retries)
        attempts.clear()
        with pytest.raises(WorkerConnectionError):
            await client.health()  # a probe is never retried
        assert attempts == ["/health"]
        await client.close()
        assert not session.closed  # a shared session is not the client's to close


async def test_refused_then_up_succeeds_on_retry() -> None:
    port = free_port()
    config = ClientConfig(max_retries=6, retry_backoff_s=0.02)
    async with SGLangClient(f"http://127.0.0.1:{port}", config) as client:
        late = ScriptedWorker()
        call = asyncio.create_task(client.generate(request()))
        await asyncio.sleep(0.03)
        await late.start(port=port)
        try:
            answer = await asyncio.wait_for(call, 10)
        finally:
            await late.stop()
    assert isinstance(answer, dict)
    assert len(late.requests_to("/generate")) == 1


async def test_dropped_after_send_is_not_retried_for_generate_but_is_for_model_info() -> None:
    """A connection that dies after the request went out: /generate may have run, so it is not resent."""
    connections: list[int] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with SGLangClient(f"http://127.0.0.1:{port}", FAST_RETRY) as client:
            with pytest.raises(WorkerConnectionError) as raised:
                await client.generate(request())
            assert raised.value.request_sent is True
            assert len(connections) == 1
            connections.clear()
            with pytest.raises(WorkerConnectionError):
                await client.model_info()
            # aiohttp itself also resends an idempotent GET once; only "retried at all" is ours to pin.
            assert len(connections) >= 1 + FAST_RETRY.max_retries
    finally:
        server.close()
        await server.wait_closed()


async def test_bad_request_raises_with_message_and_is_not_retried(
    client: SGLangClient, worker: ScriptedWorker
) -> None:
    with pytest.raises(WorkerBadRequest, match="unknown field `max_tokens`") as raised:
        await client.generate({"input_ids": [1, 2], "sampling_params": {"max_tokens": 5}})
    assert raised.value.status == 400
    assert len(worker.requests_to("/generate")) == 1
    with pytest.raises(WorkerBadRequest, match="unknown field `seed`"):
        async for _ in client.generate_stream({"input_ids": [1], "sampling_params": {"seed": 1}}):
            pass
    assert len(worker.requests_to("/generate")) == 2


async def test_timeout_raises_worker_timeout_without_retry() -> None:
    config = ClientConfig(request_timeout_s=0.05, max_retries=3, retry_backoff_s=0.001)
    async with ScriptedWorker(token_delay_s=0.1) as slow, SGLangClient(slow.url, config) as client:
        with pytest.raises(WorkerTimeout):
            await client.generate(request(max_new_tokens=4))
        assert len(slow.requests_to("/generate")) == 1


async def test_admin_bearer_is_sent_when_configured() -> None:
    async with ScriptedWorker(admin_api_key="s3cret") as guarded:
        keyed = ClientConfig(admin_api_key="s3cret", max_retries=0)
        async with SGLangClient(guarded.url, keyed) as client:
            await client.pause_generation("in_place")
            await client.continue_generation()
            await client.update_weights_from_disk("/ckpt/1", weight_version=1)
            await client.flush_cache()
            await client.abort_request(abort_all=True)
            await client.generate(request())
        by_path = {r.path: r.headers for r in guarded.requests}
        for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk",
                     "/flush_cache", "/abort_request"):
            assert by_path[path]["Authorization"] == "Bearer s3cret", path
        assert "Authorization" not in by_path["/generate"]

        async with SGLangClient(guarded.url, ClientConfig(max_retries=0)) as keyless:
            with pytest.raises(WorkerHTTPError) as raised:
                await keyless.pause_generation()
            assert raised.value.status == 401
            assert not isinstance(raised.value, WorkerBadRequest)


# ---- malformed answers ----------------------------------------------------------------------------


@pytest.fixture
async def odd_server() -> AsyncIterator[str]:
    """Answers that a real worker can produce only when something went wrong."""

    async def error_chunk(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"text": "a", "output_ids": [5], "meta_info": {}}\n\n')
        await response.write(
            b'data: {"error": {"message": "prompt too long", "type": "invalid_request_error",'
            b' "code": 400}}\n\n'
        )
        await response.write(b"data: [DONE]\n\n")
        return response

    async def burst(request: web.Request) -> web.StreamResponse:
        """Two samples' cumulative chunks, all in one write (as a reader that fell behind finds them),
        then [DONE] in another."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"".join(b"data: " + msgspec.json.encode(chunk) + b"\n\n" for chunk in BURST))
        await response.write(b"data: [DONE]\n\n")
        return response

    async def burst_error(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(
            b'data: {"text": "a", "output_ids": [5], "meta_info": {}}\n\n'
            b'data: {"text": "ab", "output_ids": [5, 6], "meta_info": {}}\n\n'
            b'data: {"error": {"message": "scheduler died", "code": 500}}\n\n'
        )
        return response

    async def no_done(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"text": "a"}\n\n')
        return response

    async def not_json(request: web.Request) -> web.Response:
        return web.Response(text="<html>proxy error</html>")

    async def server_error(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "scheduler died"}}, status=500)

    app = web.Application()
    app.router.add_post("/error_chunk/generate", error_chunk)
    app.router.add_post("/burst/generate", burst)
    app.router.add_post("/burst_error/generate", burst_error)
    app.router.add_post("/no_done/generate", no_done)
    app.router.add_post("/not_json/generate", not_json)
    app.router.add_post("/server_error/generate", server_error)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}"
    await runner.cleanup()


async def test_stream_error_chunk_raises(odd_server: str) -> None:
    async with SGLangClient(f"{odd_server}/error_chunk", FAST_RETRY) as client:
        seen = []
        with pytest.raises(WorkerBadRequest, match="prompt too long"):
            async for chunk in client.generate_stream(request()):
                seen.append(chunk)
        assert [chunk["output_ids"] for chunk in seen] == [[5]]


def _sample_chunk(index: int, output_ids: list[int], finished: bool = False) -> dict[str, Any]:
    meta = {"id": f"rid-{index}", "finish_reason": {"type": "length", "length": 3} if finished else None}
    return {"index": index, "text": "x" * len(output_ids), "output_ids": output_ids, "meta_info": meta}


BURST = [
    _sample_chunk(0, [1]), _sample_chunk(1, [7]), _sample_chunk(0, [1, 2]),
    _sample_chunk(1, [7, 8]), _sample_chunk(1, [7, 8, 9], finished=True), _sample_chunk(0, [1, 2, 3], True),
]


async def test_a_coalesced_stream_yields_the_newest_chunk_of_each_sample_per_read(odd_server: str) -> None:
    async with SGLangClient(f"{odd_server}/burst", FAST_RETRY) as client:
        every = [chunk async for chunk in client.generate_stream(request(n=2))]
        newest = [chunk async for chunk in client.generate_stream(request(n=2), coalesce=True)]
    assert every == BURST
    # In the order each sample first appeared; each sample's newest chunk is its whole answer.
    assert newest == [BURST[5], BURST[4]]


async def test_a_coalesced_stream_yields_what_came_before_an_error_chunk(odd_server: str) -> None:
    async with SGLangClient(f"{odd_server}/burst_error", FAST_RETRY) as client:
        seen = []
        with pytest.raises(WorkerHTTPError, match="scheduler died"):
            async for chunk in client.generate_stream(request(), coalesce=True):
                seen.append(chunk)
    assert [chunk["output_ids"] for chunk in seen] == [[5, 6]]


async def test_a_coalesced_stream_that_keeps_up_yields_every_chunk() -> None:
    """Chunks that arrive one by one are each relayed: coalescing drops only chunks already superseded
    when they are read."""
    async with ScriptedWorker(token_delay_s=0.02) as slow, SGLangClient(slow.url, FAST_RETRY) as client:
        chunks = [chunk async for chunk in client.generate_stream(request(max_new_tokens=4), coalesce=True)]
    assert [len(chunk["output_ids"]) for chunk in chunks] == [1, 2, 3, 4]


async def test_malformed_answers_raise_protocol_errors(odd_server: str) -> None:
    async with SGLangClient(f"{odd_server}/no_done", FAST_RETRY) as client:
        with pytest.raises(WorkerProtocolError, match=r"\[DONE\]"):
            async for _ in client.generate_stream(request()):
                pass
    async with SGLangClient(f"{odd_server}/not_json", FAST_RETRY) as client:
        with pytest.raises(WorkerProtocolError, match="invalid JSON"):
            await client.generate(request())
    async with SGLangClient(f"{odd_server}/server_error", FAST_RETRY) as client:
        with pytest.raises(WorkerHTTPError, match="scheduler died") as raised:
            await client.generate(request())
        assert raised.value.status == 500


class _Chunks:
    """Stands in for aiohttp's StreamReader: hands out fixed chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
async def test_sse_framing_survives_any_split(piece: int) -> None:
    # ~420 KiB: past aiohttp's readline limit, as a long cumulative chunk with logprobs gets.
    big = b'{"output_ids": [' + b",".join(b"123456" for _ in range(60_000)) + b"]}"
    stream = b"data: " + big + b"\n\n: keep-alive comment\n\ndata:{}\n\ndata: [DONE]\n\n"
    chunks = [stream[i : i + piece] for i in range(0, len(stream), piece)]
    events = [data async for data in iter_sse_data(_Chunks(chunks))]  # type: ignore[arg-type]
    assert events == [big, b"{}", b"[DONE]"]


# ---- shared pool ----------------------------------------------------------------------------------


async def test_worker_pool_shares_one_session() -> None:
    async with ScriptedWorker() as first, ScriptedWorker() as second:
        async with WorkerPool(FAST_RETRY, [first.url, second.url]) as pool:
            a, b = pool.clients
            assert pool.client(first.url + "/") is a
            assert a._session is b._session is pool.session
            await asyncio.gather(a.generate(request()), b.generate(request()))
            await a.close()  # a shared session is not the client's to close
            assert not pool.session.closed
            await b.generate(request())
        assert pool.session.closed
        assert len(first.requests_to("/generate")) == 1 == len(second.requests_to("/generate")) - 1


async def test_many_concurrent_generations_through_one_session(worker: ScriptedWorker) -> None:
    session = make_session(FAST_RETRY)
    async with session:
        clients = [SGLangClient(worker.url, FAST_RETRY, session=session) for _ in range(4)]
        answers = await asyncio.gather(*(c.generate(request()) for c in clients for _ in range(50)))
    assert len(answers) == 200
    assert all(answer == answers[0] for answer in answers)
