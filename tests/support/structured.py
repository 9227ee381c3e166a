"""Helpers of the structured-output tests: JSON schemas a random model can finish within a small budget
(drawn by hypothesis), and the logprobs a constrained sample should have, recomputed from the model's
own logits and the grammar replayed over the output."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from serving.engine.grammar import GrammarCache, SequenceGrammar, token_bitmasks
from serving.engine.protocol import Constraint
from serving.engine.sampling import allowed_tokens

FIELD_NAMES = ("id", "name", "count", "ok", "tags", "kind", "size")
WORDS = ("red", "green", "blue", "x", "yes")

# Strings by pattern, not maxLength: xgrammar lets raw control characters into a maxLength string,
# which is not valid JSON; every value is bounded so that a model picking tokens at random finishes.
short_strings = st.integers(1, 6).map(lambda n: {"type": "string", "pattern": f"^[a-z]{{1,{n}}}$"})
small_integers = st.tuples(st.integers(-50, 50), st.integers(0, 400)).map(
    lambda bounds: {"type": "integer", "minimum": bounds[0], "maximum": bounds[0] + bounds[1]})
booleans = st.just({"type": "boolean"})
enums = st.lists(st.sampled_from(WORDS), min_size=1, max_size=3, unique=True).map(
    lambda words: {"enum": words})
scalars = st.one_of(short_strings, small_integers, booleans, enums)
arrays = st.tuples(scalars, st.integers(1, 3)).map(
    lambda spec: {"type": "array", "items": spec[0], "maxItems": spec[1]})


@st.composite
def object_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """An object of one to four required fields: bounded strings, integers, booleans, enums, arrays."""
    names = draw(st.lists(st.sampled_from(FIELD_NAMES), min_size=1, max_size=4, unique=True))
    properties = {name: draw(st.one_of(scalars, arrays)) for name in names}
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


def constrained_logprobs(
    model: Any, grammars: GrammarCache, constraint: Constraint, prompt_ids: list[int], output_ids: list[int],
    temperature: float,
) -> list[float]:
    """Each output token's log p under the model's fp32 logits with every token the grammar forbade at
    that step removed, at the sampling temperature."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    chosen = logits[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]
    grammar = SequenceGrammar(grammars.compile(constraint))
    logprobs = []
    for step, token in enumerate(output_ids):
        [mask] = token_bitmasks([grammar], chosen.shape[1])
        assert mask is not None
        allowed = allowed_tokens(mask, chosen.shape[1])
        masked = chosen[step].masked_fill(~allowed, float("-inf"))
        logprobs.append(float(torch.log_softmax(masked / temperature, dim=-1)[token]))
        assert grammar.accept(token), f"output token {step} breaks the grammar"
    return logprobs
