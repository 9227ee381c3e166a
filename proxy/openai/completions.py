"""`POST /v1/completions`, OpenAI's legacy text completions, on the call pipeline
(proxy/openai/pipeline.py): a raw prompt (text, token ids, or a batch of them) goes to the worker without
a chat template. Each prompt × `n` is one choice (index `prompt_index * n + i`) and one recorded
completion, recorded exactly as chat's are, before the answer.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.errors import OpenAIError
from proxy.openai.pipeline import CallContext, Part, PlannedCall
from proxy.openai.schemas import CompletionRequest, Prompt
from proxy.openai.sse import DONE, sse
from proxy.openai.streaming import GenerationStream, StreamBody, StreamServices
from proxy.tokenize import ChatTokenizer
from proxy.workers.plan import ChoiceResult, context_length_error, new_completion_ids, read_choice
from proxy.workers.resume_stream import ResumingStream

TEXT_COMPLETION = "text_completion"
COMPLETION_ID_PREFIX = "cmpl"


class CompletionsApi:
    """Legacy text completions: request → plan (one part per prompt)."""

    body_model = CompletionRequest

    async def plan(
        self, call: CallContext, body: CompletionRequest, request_json: dict[str, Any]
    ) -> CompletionCall:
        tokenizer = call.services.tokenizer
        batch = body.prompts()
        # The batch in one worker thread once it is long enough to stall the event loop (text to encode,
        # token ids to check and decode), however it is split into prompts.
        if sum(len(prompt) for prompt in batch) > call.services.config.tokenize_in_thread_chars:
            prompts = await asyncio.to_thread(_tokenize_all, batch, tokenizer)
        else:
            prompts = _tokenize_all(batch, tokenizer)
        session = call.new_session()
        n = body.choices
        ids = new_completion_ids(len(prompts) * n, prefix=COMPLETION_ID_PREFIX)
        parts = [
            Part(call.plan(body, prompt_ids, session, completion_ids=ids[p * n:(p + 1) * n],
                           prompt_param="prompt"), first_index=p * n)
            for p, (prompt_ids, _text) in enumerate(prompts)
        ]
        texts = [text for _ids, text in prompts]
        return CompletionCall(session, parts, request_json, body.streaming, body, texts, tokenizer)


def _tokenize_all(prompts: list[Prompt], tokenizer: ChatTokenizer) -> list[tuple[list[int], str]]:
    return [_tokenize(prompt, tokenizer) for prompt in prompts]


def _tokenize(prompt: Prompt, tokenizer: ChatTokenizer) -> tuple[list[int], str]:
    """(prompt ids, prompt text) of one prompt; 400 for ids outside the vocabulary, a token-id prompt
    that fills the context (before it is decoded) or an empty prompt."""
    if isinstance(prompt, str):
        prompt_ids = tokenizer.encode_prompt(prompt)
        if not prompt_ids:
            raise OpenAIError(400, "The prompt is empty: it has no tokens.", "invalid_request_error",
                              param="prompt")
        return prompt_ids, prompt
    if len(prompt) >= tokenizer.context_length:
        raise context_length_error(tokenizer.context_length, len(prompt), "prompt")
    vocab = tokenizer.vocab_size
    bad = next((token for token in prompt if not 0 <= token < vocab), None)
    if bad is not None:
        raise OpenAIError(400, f"Token id {bad} in the prompt is outside the vocabulary [0, {vocab}).",
                          "invalid_request_error", param="prompt", code="invalid_value")
    return list(prompt), tokenizer.decode(prompt, skip_special_tokens=False)


@dataclass(eq=False)
class CompletionCall(PlannedCall):
    """A planned text completion: results → `text_completion` and its chunks."""

    body: CompletionRequest
    texts: list[str]
    """Each prompt's text (for echo)."""
    tokenizer: ChatTokenizer

    @property
    def envelope(self) -> dict[str, Any]:
        """The fields every chunk of the response shares."""
        first = self.parts[0].plan
        return {"id": first.response_id, "object": TEXT_COMPLETION, "created": first.created,
                "model": first.model, "system_fingerprint": None}

    def response(self, results: list[list[ChoiceResult]]) -> dict[str, Any]:
        """The `text_completion` object: choices in index order, usage over every prompt."""
        total = sum(part.plan.n for part in self.parts)
        choices = [
            self.choice(position, result, with_id=total > 1)
            for position, part_results in enumerate(results) for result in part_results
        ]
        usage = self.usage_of(range(len(self.parts)), results)
        return {**self.envelope, "choices": choices, "usage": usage}

    def usage_of(self, positions: Sequence[int], results: Sequence[Sequence[ChoiceResult]]) -> dict[str, int]:
        prompt_tokens = sum(len(self.parts[position].plan.prompt_ids) for position in positions)
        completion_tokens = sum(len(r.output_ids) for part_results in results for r in part_results)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def choice(self, position: int, result: ChoiceResult, *, with_id: bool) -> dict[str, Any]:
        """Choice `result` of the prompt at `position`."""
        part, body, tokenizer = self.parts[position], self.body, self.tokenizer
        echoed = self.texts[position] if body.echo else ""
        choice: dict[str, Any] = {
            "index": part.first_index + result.index,
            "text": echoed + result.text,
            "logprobs": None,
            "finish_reason": result.finish_reason,
        }
        if body.wants_logprobs:
            echo_ids = part.plan.prompt_ids if body.echo else []
            prompt_part, offset = legacy_logprobs(tokenizer, echo_ids, [None] * len(echo_ids), None, 0, 0)
            output_part, _ = legacy_logprobs(tokenizer, result.output_ids, result.logprobs,
                                             result.top_logprobs, body.logprobs or 0, offset)
            choice["logprobs"] = {key: prompt_part[key] + output_part[key] for key in prompt_part}
        if with_id:
            choice["completion_id"] = part.plan.completion_ids[result.index]
        if body.return_token_ids:
            choice["prompt_token_ids"] = part.plan.prompt_ids
            choice["token_ids"] = result.output_ids
        return choice

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
        payload: dict[str, Any] = {**self.envelope, "choices": choices}
        if self.body.include_usage:
            payload["usage"] = usage
        return sse(payload)

    def stream(
        self, services: StreamServices, part: Part, stream: ResumingStream, first: dict[str, Any],
        body: StreamBody,
    ) -> GenerationStream:
        return CompletionStream(services, self, self.parts.index(part), stream, first, body)

    def closing(self, ended: list[tuple[int, list[ChoiceResult]]]) -> list[bytes]:
        """Usage over every prompt (when asked), then `[DONE]`."""
        if not self.body.include_usage:
            return [DONE]
        positions = [next(p for p, part in enumerate(self.parts) if part.first_index == first)
                     for first, _results in ended]
        usage = self.usage_of(positions, [results for _first, results in ended])
        return [self.chunk([], usage=usage), DONE]


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


class CompletionStream(GenerationStream):
    """One prompt of a streaming text completion: `text_completion` chunks (`choices[].text`), the
    echoed prompt first when asked, then `finish_reason` chunks (the batch sends usage and `[DONE]`)."""

    def __init__(
        self, services: StreamServices, call: CompletionCall, position: int, stream: ResumingStream,
        first: dict[str, Any], body: StreamBody,
    ) -> None:
        part = call.parts[position]
        self.call = call
        self.body = call.body
        self.position = position
        self._logprobs_sent = [0] * part.plan.n
        self._offsets = [0] * part.plan.n  # text_offset of each choice's next token
        super().__init__(services, part.plan, call.request_json, stream, first, self.body.stop_strings(),
                         body, first_index=part.first_index)

    def _emit(self, choice: dict[str, Any]) -> None:
        index = self.first_index + choice["index"]
        self._queue.put_nowait(self.call.chunk([{**choice, "index": index}]))

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
            self._emit({"index": choice.index, "text": self.call.texts[self.position], "logprobs": logprobs,
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
        """This prompt's own `text_completion` (its choices and usage), under the response's envelope."""
        choices = [self.call.choice(self.position, result, with_id=self.plan.n > 1) for result in results]
        return {**self.call.envelope, "choices": choices,
                "usage": self.call.usage_of([self.position], [results])}

    def _emit_end(self, results: list[ChoiceResult]) -> None:
        for result in results:
            self._emit({"index": result.index, "text": "", "logprobs": None,
                        "finish_reason": result.finish_reason})
