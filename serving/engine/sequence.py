"""One sequence's state inside the decode thread, its stop rules, and the updates it sends out.

Stop rules follow SGLang 0.5.23's `Req.update_finish_state`: stop strings (and stop_regex) on the
decoded tail first, then stop token ids and EOS (unless `ignore_eos`) or a terminated grammar, then the
length budget. The matched token stays in `output_ids`, as SGLang's do; trimming is for the text only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from serving.engine.adapters import LoraAdapter
from serving.engine.grammar import SequenceGrammar
from serving.engine.protocol import SamplingOptions


@dataclass(frozen=True, slots=True)
class SequenceUpdate:
    """What a sequence produced since its last update (sent from the decode thread to the event loop)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[list[tuple[float, int]] | None, ...]
    finish_reason: dict[str, Any] | None = None
    weight_versions: tuple[tuple[str, int, int], ...] | None = None
    """(version, start, end) spans over the output tokens; only on the final update."""
    num_retractions: int = 0


def abort_reason(message: str = "Aborted") -> dict[str, Any]:
    """SGLang's FINISH_ABORT().to_json()."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


@dataclass(eq=False)
class Sequence:
    """A request's sequence while the engine owns it. Touched by the decode thread only."""

    rid: str
    prompt_ids: list[int]
    options: SamplingOptions
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    """The request's stop_token_ids plus the model's EOS ids (empty when ignore_eos)."""
    stop_str_window: int
    """Output tokens to decode when looking for a stop string (SGLang's stop_str_max_len + 1)."""
    generator: torch.Generator | None
    top_logprobs_num: int
    deliver: Callable[[SequenceUpdate], None]
    """Called with each SequenceUpdate, from the decode thread (it hops to the event loop)."""
    grammar: SequenceGrammar | None = None
    """The request's constraint, matched over this sequence's output (each of `n` samples has its own)."""
    lora: LoraAdapter | None = None
    """The LoRA adapter the request named, held for the sequence's whole life (an unload or a newer
    adapter of the same name changes only later requests, as in SGLang); None: the base model."""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    version_events: list[tuple[str, int]] = field(default_factory=list)
    """(old version, output tokens made with it) at each weight change during this sequence."""
    num_retractions: int = 0
    _unsent: list[tuple[int, float, list[tuple[float, int]] | None]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def blocked_ids(self) -> tuple[int, ...]:
        """Stop tokens are masked until min_new_tokens are out (SGLang's min_new_tokens penalizer). A grammar
        overrides it: once complete it allows only a stop token, and blocking that would leave none."""
        if (len(self.output_ids) >= self.options.min_new_tokens or self.options.ignore_eos
                or self.grammar is not None):
            return ()
        return tuple(self.stop_token_ids)

    def append(self, token_id: int, logprob: float, top: list[tuple[float, int]] | None,
               tokenizer: Any) -> None:
        """Record a sampled token and decide whether the sequence is done."""
        if self.grammar is not None and not self.grammar.accept(token_id):
            # Only when a grammar allows no token at all (the draw then ignores the mask).
            self.abort(f"Token {token_id} does not match the request's grammar.")
            return
        self.output_ids.append(token_id)
        self._unsent.append((token_id, logprob, top))
        self.finish_reason = self._check_finish(token_id, tokenizer)

    def _check_finish(self, token_id: int, tokenizer: Any) -> dict[str, Any] | None:
        opts = self.options
        if opts.stop_strs or opts.stop_regex:
            tail = tokenizer.decode(self.output_ids[-self.stop_str_window:])
            for stop in opts.stop_strs:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
            for pattern in opts.stop_regex:
                if re.search(pattern, tail):
                    return {"type": "stop", "matched": pattern}
        if token_id in self.stop_token_ids or (self.grammar is not None and self.grammar.terminated):
            return {"type": "stop", "matched": token_id}
        if len(self.output_ids) >= self.max_new_tokens:
            return {"type": "length", "length": self.max_new_tokens}
        return None

    def abort(self, message: str) -> None:
        self.finish_reason = abort_reason(message)

    def record_weight_change(self, old_version: str) -> None:
        if self.output_ids:
            self.version_events.append((old_version, len(self.output_ids)))

    def flush(self, current_version: str) -> None:
        """Send what was produced since the last flush (and the final spans when finished)."""
        if not self._unsent and not self.finished:
            return
        tokens, logprobs, tops = zip(*self._unsent, strict=True) if self._unsent else ((), (), ())
        self._unsent = []
        spans = weight_version_spans(self.version_events, current_version, len(self.output_ids)) \
            if self.finished else None
        self.deliver(SequenceUpdate(tuple(tokens), tuple(logprobs), tuple(tops), self.finish_reason,
                                    spans, self.num_retractions))


def weight_version_spans(events: list[tuple[str, int]], current: str, num_tokens: int
                         ) -> tuple[tuple[str, int, int], ...]:
    """SGLang's compute_weight_version_spans: which version made which output tokens [start, end)."""
    spans: list[list[Any]] = []
    for version, end in [*events, (current, num_tokens)]:
        end = min(end, num_tokens)
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    return tuple((v, s, e) for v, s, e in spans)
