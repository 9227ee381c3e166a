"""The event loop's side of a sequence: accumulate its updates and render SGLang's response dicts.

Text follows SGLang's detokenizer: decoded with the last prompt tokens as context (so a leading
space survives), the matched stop token dropped and the text cut at a matched stop string (unless
`no_stop_trim`); while streaming, text that ends in an incomplete UTF-8 character is held back.
"""

from __future__ import annotations

import time
from typing import Any

from serving.engine.protocol import PlannedSequence
from serving.engine.sequence import SequenceUpdate

CONTEXT_TOKENS = 5
"""Prompt tokens decoded before the output for context (SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET)."""


class IncrementalDetokenizer:
    """Cumulative streaming text without re-decoding the whole output each step."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], decode_kwargs: dict[str, bool]) -> None:
        self._tokenizer = tokenizer
        self._kwargs = decode_kwargs
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._surr = 0
        self._read = len(self._ids)
        self.text = ""
        self.consumed = 0
        """Output tokens pushed so far."""

    def push(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        self.consumed += len(token_ids)
        surr_text = self._tokenizer.decode(self._ids[self._surr:self._read], **self._kwargs)
        read_text = self._tokenizer.decode(self._ids[self._surr:], **self._kwargs)
        new_text = read_text[len(surr_text):]
        if new_text and not new_text.endswith("\ufffd"):
            self.text += new_text
            self._surr, self._read = self._read, len(self._ids)
        return self.text


def final_text(tokenizer: Any, prompt_ids: list[int], output_ids: list[int], finish: dict[str, Any] | None,
               decode_kwargs: dict[str, bool], no_stop_trim: bool) -> str:
    """The finished sequence's text, trimmed as SGLang's detokenizer trims it."""
    matched = finish.get("matched") if finish else None
    ids = output_ids
    if isinstance(matched, int) and not isinstance(matched, bool) and not no_stop_trim and ids:
        ids = ids[:-1]
    context = prompt_ids[-CONTEXT_TOKENS:]
    prefix = tokenizer.decode(context, **decode_kwargs)
    text = tokenizer.decode(context + ids, **decode_kwargs)[len(prefix):]
    if isinstance(matched, str):
        pos = text.find(matched)
        if pos != -1:
            text = text[: pos + len(matched)] if no_stop_trim else text[:pos]
    return text


class SequenceView:
    """Everything one sequence has produced so far, as the event loop sees it."""

    def __init__(self, plan: PlannedSequence, prompt_ids: list[int], tokenizer: Any, as_list: bool) -> None:
        self.plan = plan
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer
        self.as_list = as_list
        self.arrival = time.perf_counter()
        self.output_ids: list[int] = []
        self.finish_reason: dict[str, Any] | None = None
        self.weight_versions: tuple[tuple[str, int, int], ...] = ()
        self.num_retractions = 0
        self.unsent_tokens = 0
        """Tokens received since the last streamed chunk (for stream_interval)."""
        opts = plan.sampling
        self._decode_kwargs = {"skip_special_tokens": opts.skip_special_tokens,
                               "spaces_between_special_tokens": opts.spaces_between_special_tokens}
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, self._decode_kwargs)
        self._logprobs: list[list[Any]] = []
        self._top_logprobs: list[list[list[Any]] | None] = []
        self._finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, update: SequenceUpdate) -> None:
        self.output_ids.extend(update.token_ids)
        self.unsent_tokens += len(update.token_ids)
        self.num_retractions = update.num_retractions
        if self.plan.return_logprob:
            self._logprobs.extend([lp, tid, self._token_text(tid)]
                                  for lp, tid in zip(update.logprobs, update.token_ids, strict=True))
            if self.plan.top_logprobs_num > 0:
                self._top_logprobs.extend(
                    None if top is None else [[lp, tid, self._token_text(tid)] for lp, tid in top]
                    for top in update.top_logprobs)
        if update.finish_reason is not None:
            self.finish_reason = update.finish_reason
            self.weight_versions = update.weight_versions or ()
            self._finished_at = time.perf_counter()

    def _token_text(self, token_id: int) -> str | None:
        if not self.plan.return_text_in_logprobs:
            return None
        return self.tokenizer.decode([token_id])

    def due(self) -> bool:
        """Whether a streamed chunk should go out now."""
        return self.finished or self.unsent_tokens >= self.plan.sampling.stream_interval

    def render(self, weight_version: str, *, streaming: bool = False) -> dict[str, Any]:
        """The response dict: final when finished, cumulative-so-far while streaming."""
        self.unsent_tokens = 0
        if self.finished:
            text = final_text(self.tokenizer, self.prompt_ids, self.output_ids, self.finish_reason,
                              self._decode_kwargs, self.plan.sampling.no_stop_trim)
        else:
            text = self._detok.push(self.output_ids[self._detok.consumed:])
        out: dict[str, Any] = {"text": text, "output_ids": list(self.output_ids),
                               "meta_info": self._meta_info(weight_version)}
        if streaming and self.as_list:
            out["index"] = self.plan.index
        if self.plan.return_prompt_token_ids:
            out["prompt_token_ids"] = list(self.prompt_ids)
        return out

    def _meta_info(self, weight_version: str) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.plan.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
            "weight_version": weight_version,
            "num_retractions": self.num_retractions,
        }
        if self.plan.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = list(self._logprobs)
            meta["output_token_logprobs_length"] = len(self._logprobs)
            if self.plan.top_logprobs_num > 0:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = list(self._top_logprobs)
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(self.output_ids)
        meta["cached_tokens"] = 0
        if self.finished:
            visible = [s for s in self.weight_versions if s[1] < len(self.output_ids) or s[1] == 0]
            if visible:
                meta["weight_versions"] = [{"version": v, "start": s, "end": min(e, len(self.output_ids))}
                                           for v, s, e in visible]
                meta["weight_version"] = visible[-1][0]
            assert self._finished_at is not None
            meta["e2e_latency"] = self._finished_at - self.arrival
        return meta
