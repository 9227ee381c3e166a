"""`/generate` and `/health_generate`: turn a request into engine sequences and answer as SGLang does.

A plain request gets one JSON object; a batch input or `n > 1` a JSON array; `stream: true` an SSE
stream with one cumulative `data: {...}` chunk per decode step (per `stream_interval`), then
`data: [DONE]`. An aborted sequence answers HTTP 200 with its partial output.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch
import xgrammar
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from serving.engine.adapters import LoraAdapter
from serving.engine.grammar import GrammarCache, SequenceGrammar
from serving.engine.protocol import (
    BadRequest,
    Constraint,
    ContractError,
    MalformedRequest,
    PlannedSequence,
    SamplingParamsWire,
    decode_body,
    plan_generate,
    validate_sampling,
)
from serving.engine.replies import error_response, json_response
from serving.engine.responses import SequenceView
from serving.engine.scheduler import Engine, Sink
from serving.engine.sequence import Sequence, SequenceUpdate

logger = logging.getLogger(__name__)

STOP_REGEX_WINDOW = 64
"""Output tokens searched for a stop_regex match (SGLang bounds it by the pattern; we keep it simple)."""
HEALTH_CHECK_TIMEOUT_S = 20.0
DISCONNECT_POLL_S = 0.2
"""How often a waiting non-streamed request checks that its client is still there."""
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


@dataclass
class ServingState:
    """What the HTTP handlers share; built in the app's lifespan."""

    engine: Engine
    tokenizer: Any
    """The event loop's tokenizer (the decode thread has its own copy)."""
    model_path: str
    tokenizer_path: str
    served_model_name: str
    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    default_max_new_tokens: int
    max_batch_size: int
    host: str
    port: int
    worker_index: int
    update_lock: asyncio.Lock
    grammars: GrammarCache
    loras: dict[str, LoraAdapter] = field(default_factory=dict)
    """The loaded LoRA adapters by name (`serving/engine/lora.py`); requests name one with `lora_path`."""


async def generate(request: Request) -> Response:
    state: ServingState = request.app.state.serving
    try:
        plan = plan_generate(decode_body(await request.body()), vocab_size=state.vocab_size)
        grammars = await compile_grammars(state.grammars, plan.sequences)
        sink: Sink = asyncio.Queue()
        pairs = build_sequences(state, plan.sequences, sink, plan.as_list, grammars)
    except (MalformedRequest, ContractError, BadRequest) as exc:
        return error_response(exc)
    if not state.engine.running:
        return json_response({"error": {"message": "The CPU engine is shutting down."}}, 503)
    sequences = [seq for seq, _ in pairs]
    views = [view for _, view in pairs]
    state.engine.submit(sequences)
    if plan.stream:
        chunks = _stream(state.engine, sequences, views, sink)
        return StreamingResponse(chunks, media_type="text/event-stream")
    try:
        if not await _collect(request, views, sink):
            logger.info("client left before %s finished; aborted", sequences[0].rid)
            return Response(status_code=499)
    finally:
        _abort_unfinished(state.engine, sequences, views)
    results = [view.render(state.engine.weight_version) for view in views]
    return json_response(results if plan.as_list else results[0])


async def _collect(request: Request, views: list[SequenceView], sink: Sink) -> bool:
    """Apply updates until every view is finished (True), or until the client disconnects (False)."""
    getter: asyncio.Task[tuple[int, SequenceUpdate]] | None = None
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while not all(view.finished for view in views):
            getter = getter or asyncio.ensure_future(sink.get())
            done, _ = await asyncio.wait({getter}, timeout=max(0.0, next_check - time.monotonic()))
            if time.monotonic() >= next_check:  # like SGLang, stop generating for a client that hung up
                if await request.is_disconnected():
                    return False
                next_check = time.monotonic() + DISCONNECT_POLL_S
            if done:
                index, update = getter.result()
                getter = None
                views[index].apply(update)
        return True
    finally:
        if getter is not None:
            getter.cancel()


async def _stream(engine: Engine, sequences: list[Sequence], views: list[SequenceView],
                  sink: Sink) -> AsyncIterator[bytes]:
    try:
        while not all(view.finished for view in views):
            index, update = await sink.get()
            touched = {index}
            views[index].apply(update)
            while not sink.empty():  # a slow reader gets fewer, fuller chunks (they are cumulative)
                index, update = sink.get_nowait()
                views[index].apply(update)
                touched.add(index)
            for i in sorted(touched):
                if views[i].due():
                    chunk = views[i].render(engine.weight_version, streaming=True)
                    yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:  # the client went away: stop spending steps on it
        _abort_unfinished(engine, sequences, views)


def _abort_unfinished(engine: Engine, sequences: list[Sequence], views: list[SequenceView]) -> None:
    for seq, view in zip(sequences, views, strict=True):
        if not view.finished:
            engine.abort(sequence=seq)


async def compile_grammars(cache: GrammarCache, planned: list[PlannedSequence]
                           ) -> dict[Constraint, xgrammar.CompiledGrammar]:
    """The compiled grammar of every constraint the sequences carry, compiled off the event loop
    (BadRequest for one xgrammar refuses)."""
    compiled: dict[Constraint, xgrammar.CompiledGrammar] = {}
    for plan in planned:
        constraint = plan.sampling.constraint
        if constraint is None or constraint in compiled:
            continue
        grammar = cache.cached(constraint)
        if grammar is None:  # compiling takes far longer than a decode step: not on the event loop
            grammar = await asyncio.to_thread(cache.compile, constraint)
        compiled[constraint] = grammar
    return compiled


def build_sequences(state: ServingState, planned: list[PlannedSequence], sink: Sink, as_list: bool,
                    grammars: dict[Constraint, xgrammar.CompiledGrammar] | None = None,
                    ) -> list[tuple[Sequence, SequenceView]]:
    """Tokenize, check lengths against the context, and make each sequence and its view (with a matcher
    of its compiled grammar, from `grammars`, when it is constrained, and the LoRA adapter it names)."""
    tokenized: dict[str, list[int]] = {}
    pairs = []
    for index, plan in enumerate(planned):
        if plan.input_ids is not None:
            prompt_ids = plan.input_ids
        else:
            assert plan.text is not None
            if plan.text not in tokenized:
                tokenized[plan.text] = list(state.tokenizer(plan.text)["input_ids"])
            prompt_ids = tokenized[plan.text]
        max_new_tokens = _max_new_tokens(state, plan, len(prompt_ids))
        constraint = plan.sampling.constraint
        grammar = SequenceGrammar((grammars or {})[constraint]) if constraint is not None else None
        lora = _adapter(state, plan.lora_name)
        sequence = make_sequence(state, plan, prompt_ids, max_new_tokens,
                                 state.engine.deliverer(sink, index), grammar, lora)
        pairs.append((sequence, SequenceView(plan, prompt_ids, state.tokenizer, as_list)))
    return pairs


def _adapter(state: ServingState, name: str | None) -> LoraAdapter | None:
    """The loaded adapter a request names (BadRequest, SGLang's message, for one not loaded)."""
    if name is None:
        return None
    adapter = state.loras.get(name)
    if adapter is None:
        raise BadRequest(f"The following requested LoRA adapters are not loaded: {name}\n"
                         f"Loaded adapters: {sorted(state.loras)}.")
    return adapter


def _max_new_tokens(state: ServingState, plan: PlannedSequence, prompt_len: int) -> int:
    """SGLang's length checks: the prompt must fit, and so must an explicit max_new_tokens."""
    context = state.context_length
    if prompt_len == 0:
        raise BadRequest("The input is empty after tokenization.")
    if prompt_len >= context:
        raise BadRequest(f"The input ({prompt_len} tokens) is longer than the model's context length "
                         f"({context} tokens).")
    requested = plan.sampling.max_new_tokens
    if requested is not None and requested + prompt_len > context:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. "
            f"You requested a total of {requested + prompt_len} tokens: {prompt_len} tokens from the input "
            f"messages and {requested} tokens for the completion. Please reduce the number of tokens in "
            f"the input messages or the completion to fit within the limit.")
    budget = state.default_max_new_tokens if requested is None else requested
    return min(budget, context - prompt_len)


def make_sequence(state: ServingState, plan: PlannedSequence, prompt_ids: list[int], max_new_tokens: int,
                  deliver: Callable[[SequenceUpdate], None], grammar: SequenceGrammar | None = None,
                  lora: LoraAdapter | None = None) -> Sequence:
    opts = plan.sampling
    stop_ids = frozenset() if opts.ignore_eos else opts.stop_token_ids | state.eos_token_ids
    window = max([len(state.tokenizer.encode(s, add_special_tokens=False)) for s in opts.stop_strs],
                 default=0) + 1
    if opts.stop_regex:
        window = max(window, STOP_REGEX_WINDOW)
    generator = None
    if not opts.greedy:
        seed = plan.seed if plan.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
    return Sequence(rid=plan.rid, prompt_ids=list(prompt_ids), options=opts, max_new_tokens=max_new_tokens,
                    stop_token_ids=stop_ids, stop_str_window=window, generator=generator,
                    top_logprobs_num=plan.top_logprobs_num, deliver=deliver, grammar=grammar, lora=lora)


async def health_generate(request: Request) -> Response:
    """SGLang's probe: generate one token; healthy once the engine shows any progress after asking."""
    state: ServingState = request.app.state.serving
    options = validate_sampling(SamplingParamsWire(max_new_tokens=1, temperature=0.0), state.vocab_size)
    plan = PlannedSequence(rid=f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", index=0, text=None,
                           input_ids=[0], sampling=options, seed=None, return_logprob=False,
                           top_logprobs_num=0, return_text_in_logprobs=False, return_prompt_token_ids=False)
    sink: Sink = asyncio.Queue()
    probe = make_sequence(state, plan, [0], 1, state.engine.deliverer(sink, 0))
    asked = time.monotonic()
    state.engine.submit([probe])
    try:
        while time.monotonic() < asked + HEALTH_CHECK_TIMEOUT_S:
            if not sink.empty() or state.engine.last_progress > asked:
                return Response(status_code=200)
            await asyncio.sleep(0.02)
        return Response(status_code=503)
    finally:
        state.engine.abort(sequence=probe)
