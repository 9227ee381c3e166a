"""`POST /v1/completions`, OpenAI's legacy text completions: a raw prompt (text, token ids, or a batch of
them) goes to the worker without a chat template. Each prompt × `n` is one choice (index
`prompt_index * n + i`) and one recorded completion, recorded exactly as chat's are, before the answer.

Choices where OpenAI leaves room:
- A text prompt is tokenized as the tokenizer does by default (`add_special_tokens=True`: a BOS for
  Llama-style tokenizers, nothing for Qwen's), as vLLM and SGLang do; token-id prompts go as given.
- `echo` prepends the prompt text (token-id prompts decoded, special tokens kept). With `logprobs`, the
  echoed prompt tokens are listed with `null` logprobs and `null` top alternatives (the worker is not
  asked to score the prompt).
- `logprobs: k` asks the worker for the top k alternatives; where it returns none, `top_logprobs`
  holds empty dicts. Alternatives whose token text coincides share one key (a dict, as OpenAI's).
  `text_offset` counts characters of the token strings, from the start of the returned text.
- `suffix` is refused (400); `best_of` must equal `n`; `max_tokens` defaults to 16 as on OpenAI.
- A streamed batch of prompts runs one worker stream per prompt into one response body: chunks of
  different prompts interleave (each names its choice index), and `[DONE]` follows the last.
- On an online key each call starts a session of its own, owned by the key (which may reward and end
  it, as its chat sessions): raw prompts are not matched against earlier calls.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from proxy.auth import require_principal
from proxy.balancer import Worker
from proxy.chat import (
    SESSION_HEADER,
    SSE_HEADERS,
    answer_json,
    count_generated,
    open_call_session,
    record_before_answer,
)
from proxy.errors import OpenAIError
from proxy.generation import (
    ChoiceResult,
    GenerationPlan,
    generate,
    new_completion_ids,
    open_stream,
    plan_generation,
    read_choice,
)
from proxy.online import open_online_session
from proxy.request_body import decoded_body, validated_body
from proxy.responses import completion_records
from proxy.schemas import CompletionRequest, Prompt
from proxy.services import ProxyServices
from proxy.streaming import DONE, GenerationStream, sse
from proxy.tokenize import ChatTokenizer

TEXT_COMPLETION = "text_completion"
COMPLETION_ID_PREFIX = "cmpl"


@dataclass(frozen=True, slots=True)
class PromptGeneration:
    """One prompt of the request: its generation plan, its text (for echo), its first choice index."""

    plan: GenerationPlan
    text: str
    first_index: int


async def create_completion(request: Request) -> Response:
    # Taken by hand (decoded once), in FastAPI's order: unparsable JSON, the key, then the body's fields.
    request_json = await decoded_body(request)
    principal = await require_principal(request)
    services: ProxyServices = request.app.state.services
    body = validated_body(request_json, CompletionRequest)
    prompts = [await _tokenize(prompt, services) for prompt in body.prompts()]
    session_id = principal.session_id or uuid.uuid4().hex
    n = body.choices
    ids = new_completion_ids(len(prompts) * n, prefix=COMPLETION_ID_PREFIX)
    parts = [
        PromptGeneration(
            plan_generation(
                body, prompt_ids, services.tokenizer, services.config.default_max_tokens, session_id,
                services.served_model_name, completion_ids=ids[p * n:(p + 1) * n], prompt_param="prompt",
            ),
            text, p * n,
        )
        for p, (prompt_ids, text) in enumerate(prompts)
    ]
    end_call_session = None
    if principal.key_hash is not None:  # an online key: the call is a conversation of its own
        await open_online_session(services, principal.key_hash, session_id)
    elif principal.session_id is None:
        end_call_session = await open_call_session(services, session_id)
    headers = {SESSION_HEADER: session_id}
    if body.streaming:
        try:
            opened = await _open_streams(services, parts)
        except OpenAIError:
            if end_call_session is not None:
                await end_call_session()
            raise
        batch = StreamedBatch(parts[0].plan, body, end_call_session)
        for part, (worker, stream, first) in zip(parts, opened, strict=True):
            batch.streams.append(CompletionStream(services, part, batch, request_json, worker, stream, first))
        return StreamingResponse(
            batch.events(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
        )
    return await answer_json(_complete(services, parts, body, request_json), end_call_session, headers)


async def _open_streams(
    services: ProxyServices, parts: list[PromptGeneration]
) -> list[tuple[Worker, AsyncGenerator[dict[str, Any], None], dict[str, Any]]]:
    """One worker stream per prompt; if one cannot be opened, those already open are closed."""
    opened: list[tuple[Worker, AsyncGenerator[dict[str, Any], None], dict[str, Any]]] = []
    try:
        for part in parts:
            opened.append(await open_stream(services.balancer, part.plan))
    except OpenAIError:
        for _worker, stream, _first in opened:
            await stream.aclose()  # closes the worker connection (aborting there) and ends the lease
        raise
    return opened


async def _tokenize(prompt: Prompt, services: ProxyServices) -> tuple[list[int], str]:
    """(prompt ids, prompt text) of one prompt; 400 for ids outside the vocabulary or an empty prompt."""
    tokenizer = services.tokenizer
    if isinstance(prompt, str):
        if len(prompt) > services.config.tokenize_in_thread_chars:
            prompt_ids = await asyncio.to_thread(tokenizer.encode_prompt, prompt)
        else:
            prompt_ids = tokenizer.encode_prompt(prompt)
        if not prompt_ids:
            raise OpenAIError(400, "The prompt is empty: it has no tokens.", "invalid_request_error",
                              param="prompt")
        return prompt_ids, prompt
    vocab = tokenizer.vocab_size
    bad = next((token for token in prompt if not 0 <= token < vocab), None)
    if bad is not None:
        raise OpenAIError(400, f"Token id {bad} in the prompt is outside the vocabulary [0, {vocab}).",
                          "invalid_request_error", param="prompt", code="invalid_value")
    return list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)


async def _complete(
    services: ProxyServices, parts: list[PromptGeneration], body: CompletionRequest,
    request_json: dict[str, Any],
) -> dict[str, Any]:
    """Generate every prompt's choices, record them all, and return the response object."""
    outcomes = await asyncio.gather(*(generate(services.balancer, part.plan) for part in parts))
    results = list(zip(parts, outcomes, strict=True))
    response_json = text_completion(results, body, services.tokenizer)
    records = [record for part, choices in results
               for record in completion_records(part.plan, choices, request_json, response_json,
                                                part.first_index)]
    await record_before_answer(services, records)
    for part, choices in results:
        count_generated(services, part.plan, choices)
    return response_json


def text_completion(
    results: Sequence[tuple[PromptGeneration, Sequence[ChoiceResult]]], body: CompletionRequest,
    tokenizer: ChatTokenizer,
) -> dict[str, Any]:
    """The `text_completion` object: choices in index order, usage over every prompt."""
    first = results[0][0].plan
    total = sum(part.plan.n for part, _ in results)
    choices = [
        _choice(part, result, body, tokenizer, with_id=total > 1)
        for part, choice_results in results for result in choice_results
    ]
    prompt_tokens = sum(len(part.plan.prompt_ids) for part, _ in results)
    completion_tokens = sum(len(r.output_ids) for _, choice_results in results for r in choice_results)
    return {
        "id": first.response_id,
        "object": TEXT_COMPLETION,
        "created": first.created,
        "model": first.model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "system_fingerprint": None,
    }


def _choice(
    part: PromptGeneration, result: ChoiceResult, body: CompletionRequest, tokenizer: ChatTokenizer,
    *, with_id: bool,
) -> dict[str, Any]:
    echoed = part.text if body.echo else ""
    choice: dict[str, Any] = {
        "index": part.first_index + result.index,
        "text": echoed + result.text,
        "logprobs": None,
        "finish_reason": result.finish_reason,
    }
    if body.wants_logprobs:
        echo_ids = part.plan.prompt_ids if body.echo else []
        prompt_part, offset = legacy_logprobs(tokenizer, echo_ids, [None] * len(echo_ids), None, 0, 0)
        output_part, _ = legacy_logprobs(tokenizer, result.output_ids, result.logprobs, result.top_logprobs,
                                         body.logprobs or 0, offset)
        choice["logprobs"] = {key: prompt_part[key] + output_part[key] for key in prompt_part}
    if with_id:
        choice["completion_id"] = part.plan.completion_ids[result.index]
    if body.return_token_ids:
        choice["prompt_token_ids"] = part.plan.prompt_ids
        choice["token_ids"] = result.output_ids
    return choice


def legacy_logprobs(
    tokenizer: ChatTokenizer, token_ids: Sequence[int], logprobs: Sequence[float | None],
    top_logprobs: Sequence[Sequence[tuple[float, int]]] | None, top_n: int, first_offset: int,
) -> tuple[dict[str, list[Any]], int]:
    """OpenAI's legacy `logprobs` {tokens, token_logprobs, top_logprobs, text_offset}, and the text
    offset after the last token. A token with no logprob (an echoed prompt token) has null top
    alternatives; a generated one a dict, empty when the worker sent no alternatives."""
    tokens: list[str] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = first_offset
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if logprob is None:
            top.append(None)
        elif top_logprobs is not None and top_n > 0 and position < len(top_logprobs):
            top.append({tokenizer.token_text(tid): lp for lp, tid in top_logprobs[position][:top_n]})
        else:
            top.append({})
    legacy: dict[str, list[Any]] = {
        "tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets,
    }
    return legacy, offset


class StreamedBatch:
    """The prompts of one streamed request: one response body for all their streams, the end (usage,
    `[DONE]`) after the last stream ended, and the admin call's session ended after the last record."""

    def __init__(
        self, first: GenerationPlan, body: CompletionRequest,
        on_recorded: Callable[[], Awaitable[None]] | None,
    ) -> None:
        self.body = body
        self.envelope = {"id": first.response_id, "object": TEXT_COMPLETION, "created": first.created,
                         "model": first.model, "system_fingerprint": None}
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.streams: list[CompletionStream] = []
        self._on_recorded = on_recorded
        self._recorded = 0
        self._ended: list[tuple[PromptGeneration, Sequence[ChoiceResult]]] = []

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        payload: dict[str, Any] = {**self.envelope, "choices": choices}
        if self.body.include_usage:
            payload["usage"] = usage
        return sse(payload)

    async def recorded(self) -> None:
        self._recorded += 1
        if self._recorded == len(self.streams) and self._on_recorded is not None:
            await self._on_recorded()

    def ended(
        self, part: PromptGeneration, results: Sequence[ChoiceResult], tokenizer: ChatTokenizer
    ) -> None:
        """One prompt's stream ended normally; after the last, the usage chunk and `[DONE]`."""
        self._ended.append((part, results))
        if len(self._ended) < len(self.streams):
            return
        if self.body.include_usage:
            ended = sorted(self._ended, key=lambda item: item[0].first_index)
            self.queue.put_nowait(self.chunk([], usage=text_completion(ended, self.body, tokenizer)["usage"]))
        self.queue.put_nowait(DONE)

    async def events(self) -> AsyncIterator[bytes]:
        """The response body, until every stream is done. If the client leaves, stop them all."""
        remaining = len(self.streams)
        try:
            while remaining:
                item = await self.queue.get()
                if item is None:
                    remaining -= 1
                else:
                    yield item
        finally:
            for stream in self.streams:
                stream.stop_reading()


class CompletionStream(GenerationStream):
    """One prompt of a streaming text completion: `text_completion` chunks (`choices[].text`), the
    echoed prompt first when asked, then `finish_reason` chunks (the batch sends usage and `[DONE]`)."""

    def __init__(
        self, services: ProxyServices, part: PromptGeneration, batch: StreamedBatch,
        request_json: dict[str, Any], worker: Worker, stream: AsyncGenerator[dict[str, Any], None],
        first: dict[str, Any],
    ) -> None:
        self.body = batch.body
        self.part = part
        self.batch = batch
        self._logprobs_sent = [0] * part.plan.n
        self._offsets = [0] * part.plan.n  # text_offset of each choice's next token
        super().__init__(services, part.plan, request_json, worker, stream, first,
                         self.body.stop_strings(), batch.recorded, batch.queue, part.first_index)

    def _emit(self, choice: dict[str, Any]) -> None:
        index = self.part.first_index + choice["index"]
        self._queue.put_nowait(self.batch.chunk([{**choice, "index": index}]))

    def _opening(self) -> None:
        if not self.body.echo:
            return
        tokenizer = self.services.tokenizer
        prompt_ids = self.plan.prompt_ids
        for choice in self.choices:
            logprobs = None
            if self.body.wants_logprobs:
                logprobs, self._offsets[choice.index] = legacy_logprobs(
                    tokenizer, prompt_ids, [None] * len(prompt_ids), None, 0, 0
                )
            self._emit({"index": choice.index, "text": self.part.text, "logprobs": logprobs,
                        "finish_reason": None})

    def _take(self, worker_chunk: dict[str, Any]) -> None:
        choice = self._choice_of(worker_chunk)
        delta, _start, end = choice.advance(worker_chunk)
        reported = self._logprobs_sent[choice.index]
        if not delta and not (choice.finished and end > reported):
            return  # the text of these tokens is held back: their logprobs go with it
        logprobs = None
        if self.body.wants_logprobs and end > reported:
            partial = read_choice(worker_chunk, choice.index, final=False)
            top = partial.top_logprobs[reported:end] if partial.top_logprobs else None
            logprobs, self._offsets[choice.index] = legacy_logprobs(
                self.services.tokenizer, partial.output_ids[reported:end], partial.logprobs[reported:end],
                top, self.body.logprobs or 0, self._offsets[choice.index],
            )
        self._logprobs_sent[choice.index] = max(end, reported)
        self._note_content()
        self._emit({"index": choice.index, "text": delta, "logprobs": logprobs, "finish_reason": None})

    def _response(self, results: list[ChoiceResult]) -> dict[str, Any]:
        own = text_completion([(self.part, results)], self.body, self.services.tokenizer)
        return {**own, **self.batch.envelope}

    def _emit_end(self, results: list[ChoiceResult]) -> None:
        for result in results:
            self._emit({"index": result.index, "text": "", "logprobs": None,
                        "finish_reason": result.finish_reason})
        self.batch.ended(self.part, results, self.services.tokenizer)
