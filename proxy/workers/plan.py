"""From a request to a worker's `/generate` and back: the generation plan (prompt ids, SGLang sampling
params, completion ids), and the worker's answer read into per-choice results (tokens, logprobs,
per-token policy versions, finish reason), with the client-facing errors of worker failures."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from proxy.errors import OpenAIError
from proxy.parsers import OutputParser
from proxy.tokenize import ChatTokenizer
from proxy.workers.routing import Balancer
from serving.client import GenerateRequest, SamplingParams
from serving.errors import (
    WorkerBadRequest,
    WorkerConnectionError,
    WorkerError,
    WorkerHTTPError,
    WorkerProtocolError,
    WorkerTimeout,
)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
DEFAULT_TOP_P = 1.0
NO_TOP_K = -1
_MIN_TOP_P = 1e-6  # SGLang requires top_p > 0; top_p = 0 means "only the top token"
PLAIN_TEXT = OutputParser(tools=None)  # the whole text is the message content
_IDS = random.Random()
"""The completion ids' own PRNG: the `random` module's is shared with everything in the process, and
whatever seeds it (a library, a test framework generating examples) would make ids repeat."""
os.register_at_fork(after_in_child=_IDS.seed)
RETRY_SOON = {"Retry-After": "1"}
"""On a worker failure: workers come back within seconds (a restart, a weight push), and the openai
client waits this long before its own retry."""
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
CONSTRAINT_MARK = "flywheel_constraint"
"""Key of the recorded request of a completion sampled under a grammar; its value is the kind
(`json_schema`, `structural_tag`, …): its logprobs are of the constrained distribution."""


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """Everything decided before calling a worker."""

    response_id: str  # chatcmpl-…, the id of choice 0's completion
    completion_ids: tuple[str, ...]  # one per choice
    session_id: str
    created: int
    model: str  # the name the response reports (the one the client asked for)
    prompt_ids: list[int]
    worker_request: GenerateRequest
    temperature: float
    top_p: float
    top_k: int
    output: OutputParser = PLAIN_TEXT
    """How each choice's text becomes the response's message (tool calls, reasoning)."""

    @property
    def n(self) -> int:
        return len(self.completion_ids)


@dataclass(frozen=True, slots=True)
class ChoiceResult:
    """One generated choice, as the worker reported it."""

    index: int
    text: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # stop | length | abort
    top_logprobs: list[list[tuple[float, int]]] | None
    worker_rid: str | None


class SamplingRequest(Protocol):
    """What a generation plan reads from a request body (chat and legacy completions both are one)."""

    @property
    def model(self) -> str | None: ...
    @property
    def temperature(self) -> float | None: ...
    @property
    def top_p(self) -> float | None: ...
    @property
    def top_k(self) -> int | None: ...
    @property
    def min_p(self) -> float | None: ...
    @property
    def presence_penalty(self) -> float | None: ...
    @property
    def frequency_penalty(self) -> float | None: ...
    @property
    def repetition_penalty(self) -> float | None: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def logit_bias(self) -> dict[str, float] | None: ...
    @property
    def top_logprobs(self) -> int | None: ...
    @property
    def choices(self) -> int: ...
    @property
    def wants_logprobs(self) -> bool: ...
    def stop_strings(self) -> list[str]: ...
    def requested_max_tokens(self) -> int | None: ...


def new_completion_ids(n: int, prefix: str = "chatcmpl") -> tuple[str, ...]:
    """`<prefix>-<hex>` for choice 0 (the response's id); `<that>-<i>` for the others."""
    # Ids must be unique, not unguessable (a session's key guards its completions): 96 bits of a
    # urandom-seeded PRNG (reseeded on fork) instead of an os.urandom syscall per request.
    base = f"{prefix}-{_IDS.getrandbits(96):024x}"
    return (base, *(f"{base}-{i}" for i in range(1, n)))


def plan_generation(
    body: SamplingRequest, prompt_ids: list[int], tokenizer: ChatTokenizer, default_max_tokens: int,
    session_id: str, served_model: str, output: OutputParser | None = None,
    completion_ids: tuple[str, ...] | None = None, prompt_param: str = "messages",
    lora_adapter: str | None = None,
) -> GenerationPlan:
    """The worker request for `body` with its rendered prompt; 400 if the prompt leaves no room.
    `completion_ids` (one per choice) default to new `chatcmpl-` ids; `prompt_param` names the field a
    too-long prompt came from; `lora_adapter` (`serving.lora_adapter`) is the adapter the policy is served
    as."""
    room = tokenizer.context_length - len(prompt_ids)
    if room < 1:
        raise context_length_error(tokenizer.context_length, len(prompt_ids), prompt_param)
    if body.logit_bias:
        check_logit_bias(body.logit_bias, tokenizer.vocab_size)
    requested = body.requested_max_tokens()
    # A max_tokens beyond the room left is lowered to fit, as agents ask for more than small models have.
    max_new_tokens = min(requested if requested is not None else default_max_tokens, room)
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    top_p = DEFAULT_TOP_P if body.top_p is None else body.top_p
    top_k = NO_TOP_K if body.top_k is None else body.top_k
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=max(top_p, _MIN_TOP_P),
        top_k=top_k if top_k != NO_TOP_K else None,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        stop=body.stop_strings() or None,
        n=body.choices if body.choices > 1 else None,
        sampling_seed=body.seed,
        logit_bias=body.logit_bias,
    )
    constraint = (output or PLAIN_TEXT).constraint
    if constraint is not None:  # exactly one of SGLang's four grammar parameters
        sampling = msgspec.structs.replace(sampling, **{constraint.kind: constraint.text})
    completion_ids = completion_ids or new_completion_ids(body.choices)
    request = GenerateRequest(
        input_ids=prompt_ids,
        sampling_params=sampling,
        rid=completion_ids[0],
        return_logprob=True,
        top_logprobs_num=body.top_logprobs if body.wants_logprobs and body.top_logprobs else None,
        lora_path=lora_adapter,
    )
    return GenerationPlan(
        response_id=completion_ids[0],
        completion_ids=completion_ids,
        session_id=session_id,
        created=int(time.time()),
        model=body.model or served_model,
        prompt_ids=prompt_ids,
        worker_request=request,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        output=output or PLAIN_TEXT,
    )


def recorded_request(plan: GenerationPlan, request_json: dict[str, Any]) -> dict[str, Any]:
    """The request a completion of `plan` records: marked with its constraint kind when a grammar
    constrained the sampling (`CONSTRAINT_MARK`)."""
    constraint = plan.output.constraint
    return request_json if constraint is None else {**request_json, CONSTRAINT_MARK: constraint.kind}


def context_length_error(context_length: int, prompt_tokens: int, prompt_param: str) -> OpenAIError:
    """The 400 of a prompt that leaves no room in the context for output."""
    return OpenAIError(
        400,
        f"This model's maximum context length is {context_length} tokens. However, your "
        f"{prompt_param} resulted in {prompt_tokens} tokens. Please reduce the length of the "
        f"{prompt_param}.",
        "invalid_request_error", param=prompt_param, code="context_length_exceeded",
    )


def check_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> None:
    """400 for a `logit_bias` key that is no token id of the vocabulary (the worker would refuse it)."""
    for key in logit_bias or ():
        if int(key) >= vocab_size:
            raise OpenAIError(
                400, f"Invalid 'logit_bias': token id {key} is outside the vocabulary [0, {vocab_size}).",
                "invalid_request_error", param="logit_bias", code="invalid_value",
            )


def read_choice(output: dict[str, Any], index: int, *, final: bool) -> ChoiceResult:
    """One sample of a worker answer (a full answer, or a cumulative stream chunk)."""
    try:
        meta = output["meta_info"]
        output_ids = [int(t) for t in output["output_ids"]]
        entries = meta.get("output_token_logprobs") or []
        if final and len(entries) != len(output_ids):
            raise WorkerProtocolError(f"{len(entries)} logprobs for {len(output_ids)} output tokens")
        if not final:  # a partial chunk: keep only tokens whose logprobs have arrived
            output_ids = output_ids[: len(entries)]
        logprobs = [float(entry[0]) for entry in entries[: len(output_ids)]]
        top = meta.get("output_top_logprobs")
        top_logprobs = [[(float(e[0]), int(e[1])) for e in pos or ()] for pos in top] if top else None
        reason = _FINISH_REASONS.get(finish_type(output) or "stop", "stop")
        return ChoiceResult(
            index=index,
            text=str(output.get("text", "")),
            output_ids=output_ids,
            logprobs=logprobs,
            versions=token_versions(meta, len(output_ids)),
            finish_reason=reason,
            top_logprobs=top_logprobs,
            worker_rid=meta.get("id"),
        )
    except WorkerProtocolError as exc:
        raise worker_error(exc) from exc
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise worker_error(WorkerProtocolError(f"malformed /generate answer: {exc!r}")) from exc


def finish_type(output: dict[str, Any]) -> str | None:
    """`stop`, `length`, `abort`, … of a worker answer or chunk; None while it is unfinished."""
    finish = (output.get("meta_info") or {}).get("finish_reason")
    if finish is None:
        return None
    return str(finish.get("type", "stop")) if isinstance(finish, dict) else "stop"


def policy_version(weight_version: Any) -> int:
    """The integer policy version of a worker's `weight_version` ("default" is version 0)."""
    if weight_version in (None, "default"):
        return 0
    try:
        return int(str(weight_version))
    except ValueError:
        raise WorkerProtocolError(
            f"weight_version {weight_version!r} is not an integer policy version"
        ) from None


def token_versions(meta: dict[str, Any], n_tokens: int) -> list[int]:
    """Per output token, the policy version that produced it: `weight_versions` spans where the worker
    reports them (weights changed mid-request), else `weight_version` for every token."""
    fallback = policy_version(meta.get("weight_version"))
    versions = [fallback] * n_tokens
    for span in meta.get("weight_versions") or ():
        version = policy_version(span["version"])
        for position in range(max(int(span["start"]), 0), min(int(span["end"]), n_tokens)):
            versions[position] = version
    return versions


def worker_error(exc: WorkerError) -> OpenAIError:
    """A worker failure as the client should see it; a server-side one says when to retry."""
    if isinstance(exc, WorkerBadRequest):
        return OpenAIError(400, exc.message, "invalid_request_error")
    if isinstance(exc, WorkerTimeout):
        return OpenAIError(504, f"The serving worker timed out: {exc.message}", "server_error",
                           code="worker_timeout", headers=RETRY_SOON)
    if isinstance(exc, WorkerHTTPError):
        return OpenAIError(502, f"The serving worker failed (HTTP {exc.status}): {exc.message}",
                           "server_error", code="worker_error", headers=RETRY_SOON)
    if isinstance(exc, WorkerConnectionError):
        return OpenAIError(502, f"Lost the serving worker: {exc.message}", "server_error",
                           code="worker_unavailable", headers=RETRY_SOON)
    return OpenAIError(502, f"The serving worker answered badly: {exc.message}", "server_error",
                       code="worker_error", headers=RETRY_SOON)


def no_worker_error(balancer: Balancer) -> OpenAIError:
    urls = ", ".join(worker.url for worker in balancer.workers)
    return OpenAIError(
        503, f"No serving worker is reachable ({urls}).", "server_error", code="worker_unavailable",
        headers=RETRY_SOON,
    )
