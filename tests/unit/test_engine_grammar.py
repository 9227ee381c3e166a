"""Constrained decoding without servers: the sampler reads xgrammar's token bitmask, logprobs are of the
constrained distribution, grammars compile once and bad ones are 400s, a sequence ends when its grammar
does, and the proxy's forced-call grammar accepts exactly what the Hermes parser reads."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import xgrammar

from proxy.parsers import FunctionSpec, tool_call_parser
from serving.engine.grammar import GrammarCache, SequenceGrammar, token_bitmasks
from serving.engine.protocol import BadRequest, Constraint, SamplingParamsWire, validate_sampling
from serving.engine.sampling import RowSampling, allowed_tokens, choose_tokens
from serving.engine.sequence import Sequence
from serving.models.tiny import build_tokenizer

WEATHER = FunctionSpec("get_weather", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
})
CLOCK = FunctionSpec("get_time", {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}})
OBJECT_WITH_A = Constraint("json_schema", json.dumps({
    "type": "object", "properties": {"a": {"enum": ["x", "yes"]}}, "required": ["a"],
}))


@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module", name="grammars")
def grammars_fixture(tokenizer: Any) -> GrammarCache:
    return GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def options(vocab_size: int, **wire: Any) -> Any:
    return validate_sampling(SamplingParamsWire(**wire), vocab_size)


def matcher_after(grammars: GrammarCache, tokenizer: Any, constraint: Constraint, text: str
                  ) -> SequenceGrammar:
    """A sequence's grammar that has taken the tokens of `text`."""
    grammar = SequenceGrammar(grammars.compile(constraint))
    assert all(grammar.accept(token) for token in tokenizer.encode(text, add_special_tokens=False))
    return grammar


def test_allowed_tokens_read_xgrammars_bitmask_layout() -> None:
    vocab = 1030  # not a multiple of 32: the last word is partly padding
    generator = torch.Generator().manual_seed(3)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (1, words), dtype=torch.int32, generator=generator)
    logits = torch.zeros(1, vocab)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    assert torch.equal(allowed_tokens(bitmask[0], vocab), torch.isfinite(logits[0]))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["t1", "t0.7", "greedy"])
def test_constrained_logprobs_are_of_the_masked_distribution(
    grammars: GrammarCache, tokenizer: Any, temperature: float
) -> None:
    vocab = len(tokenizer)
    grammar = matcher_after(grammars, tokenizer, OBJECT_WITH_A, '{"a": ')
    [mask, none] = token_bitmasks([grammar, None], vocab)
    assert none is None and mask is not None
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(11)) * 4
    opts = options(vocab, temperature=temperature)
    rows = [RowSampling(opts, [], torch.Generator().manual_seed(seed), token_bitmask=m)
            for seed, m in ((1, mask), (2, None))]
    choice = choose_tokens(logits.clone(), rows)

    allowed = allowed_tokens(mask, vocab)
    masked = logits[0].masked_fill(~allowed, float("-inf"))
    effective = opts.temperature  # 1.0 for greedy requests
    constrained = torch.log_softmax(masked / effective, dim=-1)
    token = choice.token_ids[0]
    assert allowed[token]
    assert tokenizer.decode([token]).startswith('"')  # the only way on is a quoted enum value
    assert choice.logprobs[0] == pytest.approx(float(constrained[token]), abs=1e-5)
    assert choice.logprobs[0] <= 0.0
    # Renormalised over fewer tokens: more likely than the same token unconstrained.
    assert choice.logprobs[0] > float(torch.log_softmax(logits[0] / effective, dim=-1)[token])
    if temperature == 0.0:
        assert token == int(torch.argmax(masked))
    free = choice.token_ids[1]
    assert choice.logprobs[1] == pytest.approx(float(torch.log_softmax(logits[1] / effective, dim=-1)[free]),
                                               abs=1e-5)


def test_top_logprobs_leave_out_forbidden_tokens(grammars: GrammarCache, tokenizer: Any) -> None:
    vocab = len(tokenizer)
    grammar = matcher_after(grammars, tokenizer, OBJECT_WITH_A, '{"a": "')
    [mask] = token_bitmasks([grammar], vocab)
    allowed = allowed_tokens(mask, vocab)
    wanted = int(allowed.sum()) + 5
    row = RowSampling(options(vocab, temperature=1.0), [], torch.Generator().manual_seed(0), (), wanted, mask)
    choice = choose_tokens(torch.randn(1, vocab), [row])
    top = choice.top_logprobs[0]
    assert top is not None and len(top) == int(allowed.sum())
    assert all(allowed[token] and logprob <= 0.0 for logprob, token in top)


def test_grammars_compile_once_and_the_least_recent_is_dropped(tokenizer: Any) -> None:
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id], capacity=2)
    first = Constraint("regex", "a+")
    compiled = cache.compile(first)
    assert cache.compile(first) is compiled
    cache.compile(Constraint("regex", "b+"))
    assert cache.cached(first) is compiled  # used again: now the most recent
    cache.compile(Constraint("ebnf", 'root ::= "c"'))
    assert cache.cached(Constraint("regex", "b+")) is None
    assert cache.cached(first) is compiled


@pytest.mark.parametrize("constraint", [
    Constraint("json_schema", '{"type": "nope"}'),
    Constraint("json_schema", "not json"),
    Constraint("regex", "(("),
    Constraint("ebnf", "root ::= undefined_rule"),
    Constraint("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'),
], ids=["schema-type", "schema-json", "regex", "ebnf", "structural-tag"])
def test_a_bad_grammar_is_a_bad_request_naming_its_kind(
    grammars: GrammarCache, constraint: Constraint
) -> None:
    with pytest.raises(BadRequest) as refused:
        grammars.compile(constraint)
    message = str(refused.value)
    assert message.startswith(f"Invalid {constraint.kind}: ") and ".cc:" not in message


def test_one_grammar_per_request() -> None:
    with pytest.raises(BadRequest, match="Only one of"):
        options(100, regex="a", ebnf='root ::= "a"')
    assert options(100, regex="a").constraint == Constraint("regex", "a")
    assert options(100, regex="").constraint is None  # SGLang treats an empty one as unset


def make_sequence(tokenizer: Any, grammar: SequenceGrammar, **wire: Any) -> Sequence:
    eos = tokenizer.eos_token_id
    opts = options(len(tokenizer), **wire)
    return Sequence(rid="r", prompt_ids=[1], options=opts, max_new_tokens=50,
                    stop_token_ids=frozenset() if opts.ignore_eos else frozenset({eos}), stop_str_window=1,
                    generator=None, top_logprobs_num=0, deliver=lambda update: None, grammar=grammar)


@pytest.mark.parametrize("ignore_eos", [False, True], ids=["eos", "ignore-eos"])
def test_a_sequence_ends_when_its_grammar_does(
    grammars: GrammarCache, tokenizer: Any, ignore_eos: bool
) -> None:
    grammar = SequenceGrammar(grammars.compile(Constraint("regex", "yes")))
    seq = make_sequence(tokenizer, grammar, min_new_tokens=20, ignore_eos=ignore_eos)
    assert seq.blocked_ids == ()  # the grammar decides when the stop token may come
    for token in tokenizer.encode("yes", add_special_tokens=False):
        seq.append(token, -0.5, None, tokenizer)
        assert not seq.finished
    eos = tokenizer.eos_token_id
    seq.append(eos, -0.1, None, tokenizer)
    assert seq.finish_reason == {"type": "stop", "matched": eos}


def test_a_token_the_grammar_refuses_aborts_without_being_recorded(
    grammars: GrammarCache, tokenizer: Any
) -> None:
    seq = make_sequence(tokenizer, SequenceGrammar(grammars.compile(Constraint("regex", "yes"))))
    [no] = tokenizer.encode("n", add_special_tokens=False)
    seq.append(no, -0.5, None, tokenizer)
    assert seq.output_ids == [] and seq.finish_reason is not None and seq.finish_reason["type"] == "abort"


def hermes_calls(*calls: tuple[str, dict[str, Any]]) -> str:
    """Calls as the tiny model's chat template writes an assistant turn of them (after its first line)."""
    return "\n".join(f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
                     for name, args in calls)


def as_engine_constraint(constraint: Any) -> Constraint:
    """The proxy's constraint as the engine reads it off the wire."""
    return Constraint(constraint.kind, constraint.text)


def accepts(grammars: GrammarCache, constraint: Constraint, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(grammars.compile(constraint))
    return bool(matcher.accept_string(text)) and bool(matcher.is_completed())


def test_forced_calls_grammar_accepts_what_the_hermes_parser_reads(grammars: GrammarCache) -> None:
    parser = tool_call_parser("hermes")
    several = as_engine_constraint(parser.forced_calls([WEATHER, CLOCK], several=True))
    one = as_engine_constraint(parser.forced_calls([WEATHER], several=False))
    two_calls = hermes_calls(("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "utc"}))
    assert accepts(grammars, several, two_calls)
    content, calls = parser.parse(two_calls)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert accepts(grammars, one, hermes_calls(("get_weather", {"city": "Oslo"})))
    assert not accepts(grammars, one, two_calls)  # a named call is one call
    assert not accepts(grammars, one, hermes_calls(("get_time", {"zone": "utc"})))
    assert not accepts(grammars, one, hermes_calls(("get_weather", {"city": 3})))
    assert not accepts(grammars, several, "Sure. " + two_calls)  # calls only, no text around them
    assert not accepts(grammars, several, "")  # at least one call
