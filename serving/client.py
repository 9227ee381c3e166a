"""Async client for SGLang's native HTTP API (sglang 0.5.23): real SGLang servers and our CPU engine.

One aiohttp session (one connection pool) serves any number of workers: build a `WorkerPool`, or
pass the same `aiohttp.ClientSession` to many `SGLangClient`s. Bodies are encoded and decoded with
msgspec; the proxy's hot path pays for one `POST /generate` and nothing else.

Retry rule (`serving.retry.retry_with_backoff`, `ClientConfig.max_retries`/`retry_backoff_s`):
- only connection failures are retried, never an HTTP answer and never a timeout;
- a failure before any connection was made (refused, unresolvable, connect timeout) is retried on
  every route: the worker cannot have seen the request;
- a connection that dropped after the request went out is retried only on routes that are safe to
  repeat (GETs, pause/continue, flush, abort). `/generate` and the weight updates (from disk, the
  distributed group's calls) are never resent then, because the worker may already have run them (a
  duplicate generation would leave an orphan completion behind; a duplicate weight load is a second,
  slow load);
- a stream is never retried once its response headers have arrived.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Literal, Self, TypeVar

import aiohttp
import msgspec
from yarl import URL

from serving.config import ClientConfig
from serving.errors import (
    WorkerBadRequest,
    WorkerConnectionError,
    WorkerError,
    WorkerHTTPError,
    WorkerProtocolError,
    WorkerTimeout,
)
from serving.protocol import (
    GenerateInput,
    GenerateOutput,
    GenerateRequest,
    SamplingParams,
    encode_generate_body,
    error_message,
    iter_sse_batches,
    iter_sse_data,
)
from serving.retry import retry_with_backoff
from serving.weight_calls import WeightUpdateCalls

__all__ = [  # the wire records are re-exported: callers import them from the client
    "GenerateInput",
    "GenerateOutput",
    "GenerateRequest",
    "SGLangClient",
    "SamplingParams",
    "WorkerPool",
    "encode_generate_body",
    "error_message",
    "iter_sse_data",
    "make_session",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")

# uvicorn (and so SGLang, SGLANG_TIMEOUT_KEEP_ALIVE) closes idle keep-alive connections after 5 s.
# Dropping ours sooner means a POST never goes out on a socket the server is about to close, which
# would surface as a "dropped after sending" error that /generate must not retry.
_KEEPALIVE_S = 3.0


def make_session(config: ClientConfig) -> aiohttp.ClientSession:
    """One pooled aiohttp session for talking to workers. Call it inside a running event loop."""
    connector = aiohttp.TCPConnector(
        limit=config.max_connections, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S
    )
    return aiohttp.ClientSession(connector=connector, timeout=_request_timeout(config))


def _request_timeout(config: ClientConfig) -> aiohttp.ClientTimeout:
    # `sock_connect`, not `connect`: aiohttp's `connect` also counts waiting for a free pooled
    # connection, which under load is queueing, not a dead worker.
    return aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=config.connect_timeout_s)


def _stream_timeout(config: ClientConfig) -> aiohttp.ClientTimeout:
    # A stream may legitimately outlive request_timeout_s; bound the silence between chunks instead.
    return aiohttp.ClientTimeout(
        total=None, sock_connect=config.connect_timeout_s, sock_read=config.request_timeout_s
    )


def _http_error(status: int, message: str, url: str, path: str) -> WorkerHTTPError:
    if status == 400:
        return WorkerBadRequest(status, message, url=url, path=path)
    return WorkerHTTPError(status, message, url=url, path=path)


def _map_client_error(exc: BaseException, url: str, path: str) -> WorkerError:
    """Translate an aiohttp/asyncio failure into our typed errors (order matters: subclasses first)."""
    where = f"{url}{path}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError | aiohttp.ClientConnectorError):
        return WorkerConnectionError(f"cannot connect to {where}: {exc}", url=url, request_sent=False)
    if isinstance(exc, TimeoutError):
        return WorkerTimeout(f"timed out waiting for {where}: {exc!r}", url=url)
    if isinstance(exc, aiohttp.ClientResponseError):
        return WorkerProtocolError(f"malformed HTTP answer from {where}: {exc}", url=url)
    return WorkerConnectionError(f"connection to {where} failed: {exc!r}", url=url, request_sent=True)


class SGLangClient(WeightUpdateCalls):
    """Client of one worker at `base_url`. Cheap to build: many clients may share one session.

    Without a `session` the client makes (and on `close()` closes) its own, on first use.
    A shared session is never closed by the client.
    """

    def __init__(
        self, base_url: str, config: ClientConfig, session: aiohttp.ClientSession | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.config = config
        self._session = session
        self._owns_session = session is None
        self._timeout = _request_timeout(config)
        self._stream_timeout = _stream_timeout(config)
        self._json_headers = {"Content-Type": "application/json"}
        self._admin_headers = dict(self._json_headers)
        if config.admin_api_key:
            self._admin_headers["Authorization"] = f"Bearer {config.admin_api_key}"
        self._urls: dict[str, URL] = {}
        self._model_info_path = "/model_info"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the session if this client made it."""
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def __repr__(self) -> str:
        return f"SGLangClient({self.base_url!r})"

    # ---- generation ---------------------------------------------------------------------------

    async def generate(self, request: GenerateInput) -> GenerateOutput:
        """`POST /generate`, non-streaming. A dict for one sample; a list when n > 1 or batched."""
        body = encode_generate_body(request, stream=False)
        payload = await self._request("POST", "/generate", body, self._json_headers, idempotent=False)
        result = self._decode(payload, "/generate")
        if isinstance(result, dict):
            return result
        if isinstance(result, list) and all(isinstance(item, dict) for item in result):
            return result
        raise WorkerProtocolError(f"/generate answered {type(result).__name__}", url=self.base_url)

    async def generate_stream(
        self, request: GenerateInput, *, coalesce: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """`POST /generate` with `stream: true`: yield each SSE chunk as a dict until `data: [DONE]`.

        Chunks are cumulative (each holds the whole output so far; with n > 1 each carries its
        `index`), so the last chunk of a sample is its complete answer. With `coalesce`, of the chunks
        that arrived in one read only the newest of each sample is yielded (as SGLang's own tokenizer
        manager does with outputs that queued up): a reader that fell behind the worker catches up in
        one step instead of relaying chunks already superseded. An `{"error": ...}` chunk raises
        WorkerBadRequest/WorkerHTTPError (after the chunks before it). Leaving the loop early closes
        the connection, which makes SGLang abort the request; use `contextlib.aclosing` to do that
        promptly.
        """
        body = encode_generate_body(request, stream=True)
        response = await self._open_stream("/generate", body)
        finished = False
        # Closed here, not left to the garbage collector: an async generator dropped mid-iteration is
        # closed through the loop's finalizer hook, a call_soon_threadsafe (an eventfd write and a
        # wake-up) and one more task for every streamed request.
        batches = iter_sse_batches(response.content)
        try:
            async for batch in batches:
                newest: dict[Any, dict[str, Any]] = {}
                for data in batch:
                    if data == b"[DONE]":
                        finished = True
                        break
                    chunk = self._stream_chunk(data)
                    if "error" in chunk:
                        for earlier in newest.values():
                            yield earlier
                        raise self._stream_error(chunk["error"])
                    if coalesce:
                        newest[chunk.get("index")] = chunk
                    else:
                        yield chunk
                for chunk in newest.values():
                    yield chunk
                if finished:
                    return
            raise WorkerProtocolError("stream ended without data: [DONE]", url=self.base_url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _map_client_error(exc, self.base_url, "/generate") from exc
        finally:
            await batches.aclose()
            if finished:
                response.release()
            else:
                response.close()

    def _stream_chunk(self, data: bytes) -> dict[str, Any]:
        chunk = self._decode(data, "/generate stream")
        if not isinstance(chunk, dict):
            raise WorkerProtocolError(f"stream chunk is {type(chunk).__name__}", url=self.base_url)
        return chunk

    async def _open_stream(self, path: str, body: bytes) -> aiohttp.ClientResponse:
        url = self._url(path)

        async def attempt() -> aiohttp.ClientResponse:
            try:
                return await self._get_session().post(
                    url, data=body, headers=self._json_headers, timeout=self._stream_timeout
                )
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _map_client_error(exc, self.base_url, path) from exc

        response = await self._with_retries(attempt, path, idempotent=False)
        if response.status != 200:
            try:
                payload = await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _map_client_error(exc, self.base_url, path) from exc
            finally:
                response.release()
            raise _http_error(response.status, error_message(payload), self.base_url, path)
        return response

    def _stream_error(self, error: Any) -> WorkerHTTPError:
        if isinstance(error, dict):
            code = error.get("code")
            status = code if isinstance(code, int) and code >= 400 else 500
            return _http_error(status, str(error.get("message", error)), self.base_url, "/generate")
        return _http_error(500, str(error), self.base_url, "/generate")

    # ---- scheduling (admin routes; weight updates are in serving/weight_calls.py) -----------------------

    async def pause_generation(self, mode: PauseMode = "abort") -> dict[str, Any]:
        """Pause the scheduler: `abort` returns in-flight requests with finish_reason abort, `retract`
        puts them back in the queue (KV cache may be dropped), `in_place` freezes them as they are."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, not {mode!r}")
        return await self._admin_json("/pause_generation", {"mode": mode}, idempotent=True)

    async def continue_generation(self) -> dict[str, Any]:
        """Resume a paused scheduler."""
        return await self._admin_json("/continue_generation", {}, idempotent=True)

    async def flush_cache(self) -> None:
        """Drop the radix (prefix) cache. SGLang refuses with 400 while requests are running."""
        await self._request("POST", "/flush_cache", None, self._admin_headers, idempotent=True)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """Abort one request by its rid, or every request. Aborted requests answer with their
        partial output and finish_reason `{"type": "abort"}`."""
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        body: dict[str, Any] = {"rid": rid} if rid else {}
        if abort_all:
            body["abort_all"] = True
        await self._request(
            "POST", "/abort_request", msgspec.json.encode(body), self._admin_headers, idempotent=True
        )

    async def _admin_json(self, path: str, body: dict[str, Any], *, idempotent: bool) -> dict[str, Any]:
        payload = await self._request(
            "POST", path, msgspec.json.encode(body), self._admin_headers, idempotent=idempotent
        )
        result = self._decode(payload, path)
        if not isinstance(result, dict):
            raise WorkerProtocolError(f"{path} answered {type(result).__name__}", url=self.base_url)
        return result

    # ---- information and health ------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        """`GET /model_info` (model_path, served_model_name, weight_version, …); workers older than
        0.5.9 only have `/get_model_info`, used after a 404."""
        try:
            payload = await self._request("GET", self._model_info_path, None, None, idempotent=True)
        except WorkerHTTPError as exc:
            if exc.status != 404 or self._model_info_path == "/get_model_info":
                raise
            self._model_info_path = "/get_model_info"
            payload = await self._request("GET", self._model_info_path, None, None, idempotent=True)
        result = self._decode(payload, self._model_info_path)
        if not isinstance(result, dict):
            raise WorkerProtocolError("model_info is not an object", url=self.base_url)
        return result

    async def server_info(self) -> dict[str, Any]:
        """`GET /server_info`: the server's arguments (`tp_size`, …) and internal state."""
        result = self._decode(
            await self._request("GET", "/server_info", None, None, idempotent=True), "/server_info"
        )
        if not isinstance(result, dict):
            raise WorkerProtocolError("server_info is not an object", url=self.base_url)
        return result

    async def health(self) -> bool:
        """`GET /health`: True on 200, False on any other answer (503 while starting up).
        A probe reports the present: no retries; an unreachable worker raises WorkerConnectionError."""
        return await self._probe("/health")

    async def health_generate(self) -> bool:
        """`GET /health_generate`: like `health`, but the worker generates one token to answer."""
        return await self._probe("/health_generate")

    async def _probe(self, path: str) -> bool:
        try:
            await self._request("GET", path, None, None, idempotent=True, retries=0)
        except WorkerHTTPError:
            return False
        return True

    async def wait_until_healthy(self, timeout_s: float, poll_interval_s: float = 0.5) -> None:
        """Poll `/health` until it answers 200; raise WorkerTimeout after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerTimeout(
                    f"{self.base_url} not healthy after {timeout_s:.1f}s ({last})", url=self.base_url
                )
            try:
                async with asyncio.timeout(remaining):
                    if await self.health():
                        return
                last = "health answered non-200"
            except (WorkerConnectionError, WorkerTimeout) as exc:
                last = str(exc)
            except TimeoutError:
                pass  # the deadline cut this probe short; report the previous one's outcome
            await asyncio.sleep(min(poll_interval_s, max(deadline - time.monotonic(), 0)))

    # ---- plumbing --------------------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = make_session(self.config)
        return self._session

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    async def _request(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str] | None,
        *,
        idempotent: bool,
        retries: int | None = None,
    ) -> bytes:
        """One HTTP exchange with the retry rule of the module docstring; non-2xx raises."""
        url = self._url(path)

        async def attempt() -> tuple[int, bytes]:
            try:
                async with self._get_session().request(
                    method, url, data=body, headers=headers, timeout=self._timeout
                ) as response:
                    return response.status, await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _map_client_error(exc, self.base_url, path) from exc

        status, payload = await self._with_retries(attempt, path, idempotent=idempotent, retries=retries)
        if status >= 300:
            raise _http_error(status, error_message(payload), self.base_url, path)
        return payload

    async def _with_retries(
        self, attempt: Callable[[], Awaitable[T]], path: str, *, idempotent: bool, retries: int | None = None
    ) -> T:
        def should_retry(exc: BaseException) -> bool:
            return isinstance(exc, WorkerConnectionError) and (idempotent or not exc.request_sent)

        return await retry_with_backoff(
            attempt,
            should_retry=should_retry,
            max_retries=self.config.max_retries if retries is None else retries,
            base_delay_s=self.config.retry_backoff_s,
            description=f"{self.base_url}{path}",
        )

    def _decode(self, payload: bytes, what: str) -> Any:
        try:
            return msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise WorkerProtocolError(f"{what}: invalid JSON: {exc}", url=self.base_url) from exc


class WorkerPool:
    """One aiohttp session shared by the clients of many workers; owns and closes it.

    Create it inside a running event loop (a FastAPI lifespan, a `main()`).
    """

    def __init__(self, config: ClientConfig, urls: Iterable[str] = ()) -> None:
        self.config = config
        self._session = make_session(config)
        self._clients: dict[str, SGLangClient] = {}
        for url in urls:
            self.client(url)

    def client(self, base_url: str) -> SGLangClient:
        """The client of the worker at `base_url`, made on first request and kept."""
        key = base_url.rstrip("/")
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = SGLangClient(key, self.config, session=self._session)
        return client

    @property
    def clients(self) -> list[SGLangClient]:
        return list(self._clients.values())

    @property
    def session(self) -> aiohttp.ClientSession:
        return self._session

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
