"""Constrained decoding in the CPU engine: SGLang's `json_schema`, `regex`, `ebnf` and `structural_tag`
sampling parameters compiled with xgrammar (the grammar library SGLang uses), and one matcher per
sequence that says which tokens may come next."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import xgrammar

from serving.engine.protocol import BadRequest, Constraint

CACHE_SIZE = 256
"""Compiled grammars kept: agents send the same schema or tools call after call, and compiling costs
far more than a decode step."""
ANY_JSON = "$$ANY$$"
"""SGLang's `json_schema` value for any JSON value."""
_NATIVE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
"""xgrammar's errors start with a timestamp and a C++ source location, which tell a client nothing."""


def grammar_error(constraint: Constraint, exc: Exception) -> BadRequest:
    """The 400 of a grammar xgrammar refused, naming the parameter."""
    detail = _NATIVE_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
    return BadRequest(f"Invalid {constraint.kind}: {detail}")


class GrammarCache:
    """Compiles constraints against the served tokenizer, keeping the most recently used ones.

    Safe to call from several threads: requests compile off the event loop, and the tokenizer's
    vocabulary is read once, on the first constrained request."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 capacity: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._capacity = capacity
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: OrderedDict[Constraint, xgrammar.CompiledGrammar] = OrderedDict()

    def cached(self, constraint: Constraint) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            compiled = self._compiled.get(constraint)
            if compiled is not None:
                self._compiled.move_to_end(constraint)
            return compiled

    def compile(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `constraint` (BadRequest naming it when xgrammar refuses it)."""
        compiled = self.cached(constraint)
        if compiled is not None:
            return compiled
        compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, constraint)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad input as these
            raise grammar_error(constraint, exc) from None
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return compiled

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids)
                # xgrammar's own cache would hold every grammar ever compiled; ours is bounded.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler


def _compile(compiler: xgrammar.GrammarCompiler, constraint: Constraint) -> xgrammar.CompiledGrammar:
    kind, text = constraint.kind, constraint.text
    if kind == "json_schema":
        if text == ANY_JSON:
            return compiler.compile_builtin_json_grammar()
        # One line with ", " and ": ": free whitespace lets a weak model pad JSON without end.
        return compiler.compile_json_schema(text, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    return compiler.compile_structural_tag(text)


class SequenceGrammar:
    """One sequence's place in its grammar: which tokens may come next, and the tokens taken so far."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self._matcher = xgrammar.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (xgrammar's packed int32 layout)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Take a sampled token; False if the grammar does not allow it (the state is unchanged)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was taken: the sequence is done."""
        return bool(self._matcher.is_terminated())


def token_bitmasks(grammars: Sequence[SequenceGrammar | None], vocab_size: int) -> list[torch.Tensor | None]:
    """Each row's packed mask of allowed next tokens (None for an unconstrained row)."""
    if all(grammar is None for grammar in grammars):
        return [None] * len(grammars)
    bitmask = xgrammar.allocate_token_bitmask(len(grammars), vocab_size)
    masks: list[torch.Tensor | None] = []
    for row, grammar in enumerate(grammars):
        if grammar is None:
            masks.append(None)
            continue
        grammar.fill(bitmask, row)
        masks.append(bitmask[row])
    return masks
