"""A scripted SGLang worker: sglang 0.5.23's native HTTP protocol with canned, deterministic answers.

For tests (it records every request it receives) and as a zero-latency upstream for proxy
benchmarks (aiohttp.web + msgspec, no model). Output token i of sample j is a pure function of the
prompt, i, j and `sampling_seed`, so a streamed answer's last chunk equals the non-stream answer.

Run standalone: `python -m tests.support.scripted_worker --port 30000 [--no-record]`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

logger = logging.getLogger(__name__)

# sglang 0.5.23 `SamplingParams` keys (api_types.py): anything else is a 400, as on the real server.
SAMPLING_PARAM_KEYS: tuple[str, ...] = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "beam_width", "watermark", "choice",
)
ADMIN_ROUTES: frozenset[str] = frozenset(
    {"/update_weights_from_disk", "/pause_generation", "/continue_generation", "/flush_cache",
     "/abort_request"}
)
DEFAULT_MAX_NEW_TOKENS = 128
JSON_BODY = web.RequestKey("json_body", object)
"""The parsed JSON body, stored on the request by the middleware."""

TokenFn = Callable[[Sequence[int], int, int, int], int]
"""(prompt token ids, output position, sample index, sampling_seed) -> next token id."""


def default_token_fn(prompt_ids: Sequence[int], position: int, index: int, seed: int) -> int:
    """Deterministic tokens in [3, 1003): different per prompt, sample index and seed."""
    base = sum(prompt_ids) * 31 + len(prompt_ids) * 7 + seed * 17 + index * 101
    return (base + position * 37) % 1000 + 3


def token_text(token_id: int) -> str:
    return chr(ord("a") + token_id % 26)


def token_logprob(token_id: int, position: int) -> float:
    return -0.05 * ((token_id + position) % 20 + 1)


def unknown_field_message(key: str) -> str:
    """serde's text, as sglang 0.5.23 words the 400 for an unknown sampling_params key."""
    listed = ", ".join(f"`{name}`" for name in SAMPLING_PARAM_KEYS)
    return f"unknown field `{key}`, expected one of {listed}"


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    """Parsed JSON body; None when empty or not JSON."""


class _Killed(Exception):
    """The worker was killed (`crash_after_tokens`): drop the connection."""


class _BadRequest(Exception):
    def __init__(self, payload: Any) -> None:
        super().__init__(str(payload))
        self.payload = payload


@dataclass
class _Sample:
    """One sequence being generated."""

    rid: str
    prompt_ids: list[int]
    index: int
    seed: int
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    return_logprob: bool
    top_logprobs_num: int
    output_ids: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    abort_message: str | None = None


class ScriptedWorker:
    """An aiohttp.web app speaking SGLang's native API. State is per instance; start/stop it per test."""

    def __init__(
        self,
        *,
        model_path: str = "scripted/model",
        served_model_name: str | None = None,
        admin_api_key: str | None = None,
        weight_version: str = "default",
        token_fn: TokenFn = default_token_fn,
        eos_token_id: int | None = None,
        token_delay_s: float = 0.0,
        record: bool = True,
        legacy_model_info: bool = False,
    ) -> None:
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.admin_api_key = admin_api_key
        self.weight_version = weight_version
        self.token_fn = token_fn
        self.eos_token_id = eos_token_id
        self.token_delay_s = token_delay_s
        self.record = record
        self.legacy_model_info = legacy_model_info
        """Answer 404 on /model_info, as sglang < 0.5.9 did (only /get_model_info)."""
        self.healthy = True
        """False makes /health and /health_generate answer 503 (a server still starting)."""
        self.weight_load_error: str | None = None
        """When set, /update_weights_from_disk fails with this message (HTTP 400, success false)."""
        self.crash_after_tokens: int | None = None
        """When set, a /generate whose sample reaches this many output tokens kills the worker: that
        connection is dropped (a stream after sending the chunk with those tokens) and from then on every
        connection is dropped and /health is never answered 200 again, as with a killed process."""
        self.dead = False
        self.generate_status: int | None = None
        """When set, /generate answers this HTTP status with an error body (a worker failing)."""
        self.pause_after_tokens: int | None = None
        """When set, a sample reaching this many output tokens pauses the worker in abort mode (as a
        weight push does, at a known token); continue it with `set_paused(None)`."""
        self.requests: list[RecordedRequest] = []
        self.paused_mode: str | None = None
        self._changed = asyncio.Event()
        self._in_flight: dict[int, _Sample] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.app = self._build_app()

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (0 picks a free port); returns the base URL."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=4096)  # many clients connect at once
        await site.start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ScriptedWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def requests_to(self, path: str) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path == path]

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=1 << 30)
        app.router.add_route("POST", "/generate", self._generate)
        app.router.add_route("PUT", "/generate", self._generate)
        app.router.add_post("/update_weights_from_disk", self._update_weights_from_disk)
        app.router.add_post("/pause_generation", self._pause_generation)
        app.router.add_post("/continue_generation", self._continue_generation)
        app.router.add_post("/abort_request", self._abort_request)
        app.router.add_route("*", "/flush_cache", self._flush_cache)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._get_model_info)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.dead:
            return _drop(request)
        raw = await request.read()
        body: Any = None
        if raw:
            try:
                body = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                return _json({"error": {"message": "invalid JSON body"}}, status=400)
        request[JSON_BODY] = body
        if self.record:
            self.requests.append(RecordedRequest(request.method, request.path, dict(request.headers), body))
        if self.admin_api_key and request.path in ADMIN_ROUTES:
            if request.headers.get("Authorization") != f"Bearer {self.admin_api_key}":
                return _json({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except _BadRequest as exc:
            return _json({"error": exc.payload}, status=400)
        except _Killed:
            return _drop(request)

    # ---- state changes (pause, continue, abort, weights) wake waiting generations --------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _abort(self, message: str, rid: str | None = None) -> None:
        for sample in self._in_flight.values():
            if rid is None or sample.rid.startswith(rid):
                sample.abort_message = message
        self._notify()

    # ---- /generate ------------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if self.generate_status is not None:
            return _json({"error": {"message": "the worker is failing"}}, status=self.generate_status)
        body = request[JSON_BODY]
        samples, as_list = self._parse_generate(body)
        for sample in samples:
            self._in_flight[id(sample)] = sample
        try:
            if body.get("stream"):
                return await self._stream(request, samples, indexed=as_list)
            if len(samples) == 1:
                await self._run(samples[0])
            else:
                await asyncio.gather(*(self._run(sample) for sample in samples))
            answers = [self._answer(sample) for sample in samples]
            return _json(answers if as_list else answers[0])
        finally:
            for sample in samples:
                self._in_flight.pop(id(sample), None)
            self._notify()

    async def _stream(
        self, request: web.Request, samples: list[_Sample], *, indexed: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        active = list(samples)
        while active:
            for sample in list(active):
                await self._gate(sample)
                self._step(sample)
                chunk = self._answer(sample)
                if indexed:
                    chunk["index"] = sample.index
                await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                self._maybe_die(sample)
                if sample.finish_reason is not None:
                    active.remove(sample)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _run(self, sample: _Sample) -> None:
        while sample.finish_reason is None:
            await self._gate(sample)
            self._step(sample)
            self._maybe_die(sample)

    def _maybe_die(self, sample: _Sample) -> None:
        if self.crash_after_tokens is not None and len(sample.output_ids) >= self.crash_after_tokens:
            self.dead = True
            self.healthy = False
            raise _Killed

    def set_paused(self, mode: str | None) -> None:
        """Pause (`in_place` holds requests, `abort` also aborts those in flight) or continue (None), as
        /pause_generation and /continue_generation do. Call it on the worker's event loop."""
        self.paused_mode = mode
        if mode == "abort":
            self._abort("Abort by pause_generation")
        self._notify()

    async def _gate(self, sample: _Sample) -> None:
        """Per-step latency, and the pause: a paused scheduler holds requests until continue/abort."""
        if self.token_delay_s:
            await asyncio.sleep(self.token_delay_s)
        while self.paused_mode is not None and sample.abort_message is None:
            await self._changed.wait()

    def _step(self, sample: _Sample) -> None:
        if sample.abort_message is not None:
            sample.finish_reason = {"type": "abort", "message": sample.abort_message}
            return
        if len(sample.output_ids) >= sample.max_new_tokens:
            sample.finish_reason = {"type": "length", "length": sample.max_new_tokens}
            return
        token = self.token_fn(sample.prompt_ids, len(sample.output_ids), sample.index, sample.seed)
        sample.output_ids.append(token)
        sample.versions.append(self.weight_version)
        if len(sample.output_ids) == self.pause_after_tokens:
            self.set_paused("abort")
        if token in sample.stop_token_ids or token == self.eos_token_id:
            sample.finish_reason = {"type": "stop", "matched": token}
            return
        sample.text += token_text(token)
        for stop in sample.stop_strings:
            at = sample.text.find(stop)
            if at >= 0:
                sample.text = sample.text[:at]
                sample.finish_reason = {"type": "stop", "matched": stop}
                return
        if len(sample.output_ids) >= sample.max_new_tokens:
            sample.finish_reason = {"type": "length", "length": sample.max_new_tokens}

    def _answer(self, sample: _Sample) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": sample.rid,
            "finish_reason": sample.finish_reason,
            "prompt_tokens": len(sample.prompt_ids),
            "weight_version": sample.versions[-1] if sample.versions else self.weight_version,
            "completion_tokens": len(sample.output_ids),
            "cached_tokens": 0,
            "e2e_latency": 0.0,
        }
        if sample.return_logprob:
            entries = [[token_logprob(t, i), t, None] for i, t in enumerate(sample.output_ids)]
            meta["output_token_logprobs"] = entries
            if sample.top_logprobs_num > 0:
                meta["output_top_logprobs"] = [
                    [[lp - k, t + k, None] for k in range(sample.top_logprobs_num)] for lp, t, _ in entries
                ]
        spans = _version_spans(sample.versions)
        if len(spans) > 1:
            meta["weight_versions"] = spans
        return {"text": sample.text, "output_ids": list(sample.output_ids), "meta_info": meta}

    def _parse_generate(self, body: Any) -> tuple[list[_Sample], bool]:
        """The samples a /generate body asks for, and whether the answer is an array."""
        if not isinstance(body, dict):
            raise _BadRequest("invalid type: expected struct GenerateRequest")
        prompts, batched = _prompts(body)
        params = body.get("sampling_params") or {}
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        for sampling in per_prompt:
            for key in sampling:
                if key not in SAMPLING_PARAM_KEYS:
                    raise _BadRequest(unknown_field_message(key))
        return_logprob = bool(body.get("return_logprob"))
        top_logprobs_num = int(body.get("top_logprobs_num") or 0)
        samples: list[_Sample] = []
        for prompt, sampling in zip(prompts, per_prompt, strict=True):
            n = int(sampling.get("n") or 1)
            stop = sampling.get("stop") or ()
            for _ in range(n):
                samples.append(_Sample(
                    rid=uuid.uuid4().hex,
                    prompt_ids=prompt,
                    index=len(samples),
                    seed=int(sampling.get("sampling_seed") or 0),
                    max_new_tokens=_max_new_tokens(sampling),
                    stop_token_ids=frozenset(sampling.get("stop_token_ids") or ()),
                    stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
                    return_logprob=return_logprob,
                    top_logprobs_num=top_logprobs_num,
                ))
        as_list = batched or len(samples) > 1
        if not as_list and isinstance(body.get("rid"), str):
            samples[0].rid = body["rid"]
        return samples, as_list

    # ---- admin and information routes -------------------------------------------------------------

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = request[JSON_BODY]
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str):
            return _validation_error("model_path: Field required")
        if self.weight_load_error is not None:
            return _json({"success": False, "message": self.weight_load_error, "num_paused_requests": 0}, 400)
        if body.get("abort_all_requests"):
            self._abort("Abort by update_weights_from_disk(abort_all_requests=True)")
        # SGLang's writer lock: a running (not paused) scheduler finishes in-flight requests first.
        while self._in_flight and self.paused_mode is None:
            await self._changed.wait()
        self.model_path = body["model_path"]
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        self._notify()
        return _json(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    async def _pause_generation(self, request: web.Request) -> web.Response:
        body = request[JSON_BODY] or {}
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return _validation_error(f"mode: Input should be 'abort', 'retract' or 'in_place', not {mode!r}")
        self.paused_mode = mode
        if mode == "abort":
            self._abort("Abort by pause_generation")
        self._notify()
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, request: web.Request) -> web.Response:
        self.paused_mode = None
        self._notify()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort_request(self, request: web.Request) -> web.Response:
        body = request[JSON_BODY] or {}
        if body.get("abort_all"):
            self._abort("Abort by abort_request(abort_all=True)")
        elif body.get("rid"):
            self._abort("Abort by abort_request", rid=body["rid"])
        return web.Response(status=200)

    async def _flush_cache(self, request: web.Request) -> web.Response:
        if self._in_flight:
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(text="Cache flushed.\n")

    async def _model_info(self, request: web.Request) -> web.Response:
        if self.legacy_model_info:
            return _json({"detail": "Not Found"}, status=404)
        return await self._get_model_info(request)

    async def _get_model_info(self, request: web.Request) -> web.Response:
        return _json({
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": None,
            "reasoning_parser": None,
            "tool_call_parser": None,
        })

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)


def _drop(request: web.Request) -> web.Response:
    """Close the connection without an answer (the returned response is never sent)."""
    if request.transport is not None:
        request.transport.abort()
    return web.Response(status=500)


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(payload), status=status, content_type="application/json")


def _validation_error(message: str) -> web.Response:
    """FastAPI request validation failure, as SGLang reshapes it (HTTP 400, ErrorResponse)."""
    error = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return _json(error, status=400)


def _prompts(body: dict[str, Any]) -> tuple[list[list[int]], bool]:
    input_ids, text = body.get("input_ids"), body.get("text")
    if (input_ids is None) == (text is None):
        raise _BadRequest({"message": "Either text or input_ids should be provided."})
    if text is not None:
        texts = [text] if isinstance(text, str) else list(text)
        return [list(t.encode()) for t in texts], not isinstance(text, str)
    if input_ids and isinstance(input_ids[0], list):
        return [list(ids) for ids in input_ids], True
    return [list(input_ids)], False


def _max_new_tokens(sampling: dict[str, Any]) -> int:
    value = sampling.get("max_new_tokens")
    return DEFAULT_MAX_NEW_TOKENS if value is None else int(value)


def _version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """sglang 0.5.23's `weight_versions`: one {version, start, end} per run of output tokens."""
    spans: list[dict[str, Any]] = []
    for position, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = position + 1
        else:
            spans.append({"version": version, "start": position, "end": position + 1})
    return spans


async def eventually(condition: Callable[[], bool], timeout_s: float = 5.0, poll_s: float = 0.001) -> None:
    """For tests: wait until `condition()` holds (e.g. a request reached the worker), else fail."""
    for _ in range(max(1, int(timeout_s / poll_s))):
        if condition():
            return
        await asyncio.sleep(poll_s)
    raise AssertionError(f"condition not met within {timeout_s}s")


async def _serve(args: argparse.Namespace) -> None:
    worker = ScriptedWorker(
        admin_api_key=args.admin_api_key, token_delay_s=args.token_delay_s, record=not args.no_record
    )
    url = await worker.start(args.host, args.port)
    logger.info("scripted SGLang worker on %s", url)
    try:
        await asyncio.Event().wait()
    finally:
        await worker.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--admin-api-key", default=None)
    parser.add_argument("--token-delay-s", type=float, default=0.0)
    parser.add_argument("--no-record", action="store_true", help="do not keep received requests (benchmarks)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
