"""Generations that survive weight pushes and lost workers.

A worker paused for a weight push (`pause_generation` abort/retract on SGLang versions that abort) answers
in-flight requests HTTP 200 with finish_reason `{"type": "abort"}` and the partial output; a worker that
dies drops the connection or answers 5xx. Either way each unfinished choice is re-issued as
`input_ids = prompt + tokens so far`, `max_new_tokens = what is left`, same sampling params, on a worker
in rotation (the session's own after a pause: it then serves the new weights), and the pieces are
stitched into one answer as if one request had produced it: output ids, logprob entries, per-token
policy versions (each token keeps the version that produced it), the last piece's finish reason.

Detecting the pause: nothing to poll. A request sent to a paused worker waits in its queue until
`continue_generation` (SGLang, the CPU engine and the scripted worker all hold new requests while
paused), so a re-issued piece simply starts once the new weights serve. A piece that is aborted again
before producing a token backs off (50 ms doubling to 2 s); attempts and total time are bounded
(`proxy.resume_max_attempts`, `proxy.resume_timeout_s`), after which the choice is recorded as aborted.

Aborts the proxy causes itself (the client left a stream: `/abort_request`) are never seen here: the
stream's reader is cancelled first, so they are recorded as abort, not resumed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from proxy.errors import OpenAIError
from proxy.workers.plan import GenerationPlan, no_worker_error, token_versions, worker_error
from proxy.workers.routing import Balancer, Decode, RoutingPolicy
from serving.client import GenerateRequest
from serving.errors import WorkerBadRequest, WorkerConnectionError, WorkerError, WorkerHTTPError

logger = logging.getLogger(__name__)

Chunks = AsyncGenerator[dict[str, Any], None]
"""A worker's cumulative `/generate` chunks (or merged ones)."""

_REPLACEMENT = "\ufffd"  # what a decoder makes of a UTF-8 character cut in two
_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0


def resumable(output: dict[str, Any]) -> bool:
    """An abort worth resuming: not one that names a client error (SGLang aborts an invalid request
    with a 4xx `status_code`; generating again would only repeat it)."""
    finish = (output.get("meta_info") or {}).get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") != "abort":
        return False
    status = finish.get("status_code")
    return not (isinstance(status, int) and 400 <= status < 500)


def is_lost(exc: WorkerError) -> bool:
    """A failure that says the worker is gone (or going), not that the request was bad."""
    if isinstance(exc, WorkerConnectionError):
        return True
    return isinstance(exc, WorkerHTTPError) and not isinstance(exc, WorkerBadRequest) and exc.status >= 500


@dataclass(frozen=True, slots=True)
class Prefix:
    """What the earlier pieces of one choice generated."""

    output_ids: list[int]
    entries: list[Any]  # output_token_logprobs entries, one per output id
    top: list[Any] | None
    versions: list[int]
    text: str

    @classmethod
    def empty(cls) -> Prefix:
        return cls([], [], None, [], "")

    @classmethod
    def of(cls, output: dict[str, Any], decode: Decode | None) -> Prefix:
        """The tokens of `output` that have logprobs (the others are generated again)."""
        meta = output.get("meta_info") or {}
        entries = list(meta.get("output_token_logprobs") or ())
        all_ids = [int(t) for t in output.get("output_ids") or ()]
        ids = all_ids[: len(entries)]
        text = str(output.get("text", ""))
        if len(ids) < len(all_ids) and decode is not None:
            text = decode(ids)
        top = meta.get("output_top_logprobs")
        return cls(ids, entries[: len(ids)], list(top[: len(ids)]) if top else None,
                   token_versions(meta, len(ids)), text)


def version_spans(versions: Sequence[int]) -> list[dict[str, Any]]:
    """SGLang's `weight_versions`: one {version, start, end} per run of equal versions."""
    spans: list[dict[str, Any]] = []
    for position, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = position + 1
        else:
            spans.append({"version": str(version), "start": position, "end": position + 1})
    return spans


def join_text(prefix: Prefix, piece_ids: list[int], piece_text: str, decode: Decode | None) -> str:
    """The text of prefix + piece. Plain concatenation unless the boundary cut a UTF-8 character (a
    U+FFFD on either side): then the joined ids are decoded, less what the worker held back or trimmed
    from the piece's own text (a matched stop string)."""
    if decode is None or not (prefix.text.endswith(_REPLACEMENT) or piece_text.startswith(_REPLACEMENT)):
        return prefix.text + piece_text
    whole_piece = decode(piece_ids)
    held = len(whole_piece) - len(piece_text) if whole_piece.startswith(piece_text) else 0
    joined = decode(prefix.output_ids + piece_ids)
    return joined[: len(joined) - held] if held > 0 else joined


def merge(prefix: Prefix, piece: dict[str, Any], decode: Decode | None) -> dict[str, Any]:
    """A piece's answer (or cumulative chunk) as the whole choice's: prefix + piece."""
    if not prefix.output_ids:
        return piece
    meta = piece.get("meta_info") or {}
    ids = [int(t) for t in piece.get("output_ids") or ()]
    versions = prefix.versions + token_versions(meta, len(ids))
    merged_meta = dict(meta)
    merged_meta["output_token_logprobs"] = prefix.entries + list(meta.get("output_token_logprobs") or ())
    top = meta.get("output_top_logprobs")
    if prefix.top is not None and top:
        merged_meta["output_top_logprobs"] = prefix.top + list(top)
    else:
        merged_meta.pop("output_top_logprobs", None)
    merged_meta["weight_versions"] = version_spans(versions)
    merged_meta["weight_version"] = str(versions[-1])
    merged_meta["completion_tokens"] = len(versions)
    text = join_text(prefix, ids, str(piece.get("text", "")), decode)
    return {**piece, "text": text, "output_ids": prefix.output_ids + ids, "meta_info": merged_meta}


def stop_strings(plan: GenerationPlan) -> tuple[str, ...]:
    params = plan.worker_request.sampling_params
    stop = params.stop if params is not None else None
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def straddling_stop(prefix: Prefix, text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(position, stop string) of the first stop string that begins in the prefix's text and ends after
    it: the worker of the resumed piece saw only its own text, so it could not match it."""
    boundary = len(prefix.text)
    found: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(boundary - len(stop) + 1, 0))
        if 0 <= at < boundary < at + len(stop) and (found is None or at < found[0]):
            found = (at, stop)
    return found


def stopped_at(merged: dict[str, Any], at: int, stop: str) -> dict[str, Any]:
    """`merged` ended by `stop` found at text position `at`: the text cut there, as the worker cuts it."""
    meta = {**(merged.get("meta_info") or {}), "finish_reason": {"type": "stop", "matched": stop}}
    return {**merged, "text": str(merged.get("text", ""))[:at], "meta_info": meta}


def cut_piece(piece: dict[str, Any], n_tokens: int) -> dict[str, Any]:
    """The first `n_tokens` of a finished piece."""
    meta = dict(piece.get("meta_info") or {})
    for key in ("output_token_logprobs", "output_top_logprobs"):
        if meta.get(key):
            meta[key] = meta[key][:n_tokens]
    return {**piece, "output_ids": list(piece.get("output_ids") or ())[:n_tokens], "meta_info": meta}


def end_at_straddling_stop(
    prefix: Prefix, piece: dict[str, Any], stops: Sequence[str], decode: Decode | None
) -> dict[str, Any]:
    """A finished piece merged onto `prefix`, ended where a stop string straddling the boundary
    completes (the token that completes it kept, as SGLang keeps it); needs `decode` to find that token."""
    merged = merge(prefix, piece, decode)
    found = straddling_stop(prefix, str(merged.get("text", "")), stops) if stops else None
    if found is None or decode is None:
        return merged
    at, stop = found
    piece_ids = [int(t) for t in piece.get("output_ids") or ()]
    for n_tokens in range(1, len(piece_ids) + 1):
        if len(decode(prefix.output_ids + piece_ids[:n_tokens])) >= at + len(stop):
            return stopped_at(merge(prefix, cut_piece(piece, n_tokens), decode), at, stop)
    return merged


def with_length_finish(output: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """An aborted output that already has every token asked for: it finished by length."""
    meta = {**(output.get("meta_info") or {}), "finish_reason": {"type": "length", "length": max_new_tokens}}
    return {**output, "meta_info": meta}


def resume_request(plan: GenerationPlan, index: int, prefix: Prefix, attempt: int) -> GenerateRequest | None:
    """Choice `index` continued after `prefix`; None when no tokens are left to generate."""
    base = plan.worker_request
    params = base.sampling_params
    assert params is not None and params.max_new_tokens is not None  # plan_generation sets both
    remaining = params.max_new_tokens - len(prefix.output_ids)
    if remaining <= 0:
        return None
    sampling = msgspec.structs.replace(params, max_new_tokens=remaining, n=None)
    return msgspec.structs.replace(
        base, input_ids=plan.prompt_ids + prefix.output_ids, sampling_params=sampling,
        rid=f"{plan.completion_ids[index]}-resume{attempt}",
    )


class ResumeBudget:
    """Bounded re-issues of one choice: attempts, total time, and backoff while nothing progresses."""

    def __init__(self, policy: RoutingPolicy) -> None:
        self.used = 0
        self._max = policy.resume_max_attempts
        self._deadline = time.monotonic() + policy.resume_timeout_s
        self._delay = _FIRST_BACKOFF_S

    def take(self) -> bool:
        if self.used >= self._max or time.monotonic() >= self._deadline:
            return False
        self.used += 1
        return True

    async def after(self, progressed: bool) -> None:
        """Back off (doubling) after a piece that produced nothing; reset after one that did."""
        if progressed:
            self._delay = _FIRST_BACKOFF_S
            return
        await asyncio.sleep(min(self._delay, max(self._deadline - time.monotonic(), 0.0)))
        self._delay = min(self._delay * 2, _MAX_BACKOFF_S)


async def call_worker(balancer: Balancer, session_id: str, request: GenerateRequest) -> list[dict[str, Any]]:
    """One non-streaming `/generate`, re-issued on the next worker when one is lost (refused or dropped
    connection, 5xx). The answer's samples, in order."""
    lost: WorkerError | None = None
    for worker in balancer.candidates(session_id):
        with balancer.lease(worker, session_id):
            try:
                output = await worker.client.generate(request)
            except WorkerError as exc:
                if not is_lost(exc):
                    raise worker_error(exc) from exc
                balancer.mark_failed(worker, "connect" if isinstance(exc, WorkerConnectionError) else "http")
                lost = exc
                continue
        balancer.mark_ok(worker)
        return output if isinstance(output, list) else [output]
    if isinstance(lost, WorkerHTTPError):
        raise worker_error(lost)
    raise no_worker_error(balancer)


async def resume_choice(
    balancer: Balancer, plan: GenerationPlan, index: int, output: dict[str, Any]
) -> dict[str, Any]:
    """Choice `index`'s aborted `output`, continued until it finishes otherwise (or the budget ends)."""
    budget = ResumeBudget(balancer.policy)
    merged = output
    while resumable(merged):
        prefix = Prefix.of(merged, balancer.decode)
        request = resume_request(plan, index, prefix, budget.used + 1)
        if request is None:
            return with_length_finish(merged, len(prefix.output_ids))
        if not budget.take():
            logger.warning("%s: gave up resuming after %d attempts", plan.completion_ids[index], budget.used)
            return merged
        balancer.count_resume("abort")
        try:
            piece = (await call_worker(balancer, plan.session_id, request))[0]
        except OpenAIError as exc:
            logger.warning("%s: could not resume: %s", plan.completion_ids[index], exc.message)
            return merged
        merged = end_at_straddling_stop(prefix, piece, stop_strings(plan), balancer.decode)
        await budget.after(len(merged.get("output_ids") or ()) > len(prefix.output_ids))
    return merged


async def generate_outputs(balancer: Balancer, plan: GenerationPlan) -> list[dict[str, Any]]:
    """The plan's samples, each complete: aborted choices resumed (each on its own)."""
    outputs = await call_worker(balancer, plan.session_id, plan.worker_request)
    if len(outputs) != plan.n or not any(resumable(o) for o in outputs):
        return outputs
    return list(await asyncio.gather(*(
        resume_choice(balancer, plan, i, o) if resumable(o) else _done(o)
        for i, o in enumerate(outputs)
    )))


async def _done(output: dict[str, Any]) -> dict[str, Any]:
    return output
