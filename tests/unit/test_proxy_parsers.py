"""Tool-call and reasoning parsers: the non-streaming result of known texts, and the incremental parser
giving exactly that result whatever the chunking of the text."""

from __future__ import annotations

import json
import random

import pytest

from proxy.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ContentDelta,
    OutputParser,
    ParsedOutput,
    ParsedToolCall,
    ReasoningDelta,
    ToolCallDelta,
    reasoning_parser,
    tool_call_parser,
)
from proxy.parsers.base import held_prefix_length

HERMES = TOOL_CALL_PARSERS["hermes"]


def block(name: str, arguments: dict[str, object]) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


ONE_CALL = block("get_weather", {"city": "Paris", "unit": "c"})
TWO_CALLS = block("a", {"x": 1}) + "\n" + block("b", {"y": [1, 2]})
CONTENT_FIRST = "Let me check.\n\n" + block("get_weather", {"city": "Oslo"})
MALFORMED = 'Try <tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call> done'
UNTERMINATED = 'Text <tool_call>\n{"name": "f", "arguments": {}}'
MIXED = (
    "  Lead  " + block("a", {"q": "ü <tool_call>"}) + " mid <tool_call>not json</tool_call>\n"
    + block("b", {}) + "\n tail  "
)
THINKING = "<think>\n  Reason a bit.\n</think>\n\nThe answer.  "


def test_hermes_one_call_has_no_content() -> None:
    content, calls = HERMES.parse(ONE_CALL)
    assert content is None
    assert calls == [ParsedToolCall("get_weather", '{"city": "Paris", "unit": "c"}')]


def test_hermes_two_calls_are_parallel() -> None:
    content, calls = HERMES.parse(TWO_CALLS)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {"y": [1, 2]})]


def test_hermes_content_before_calls_is_kept_without_the_markup() -> None:
    content, calls = HERMES.parse(CONTENT_FIRST)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather"]


def test_hermes_malformed_json_stays_content() -> None:
    assert HERMES.parse(MALFORMED) == (MALFORMED, [])


def test_hermes_unterminated_tag_stays_content() -> None:
    assert HERMES.parse(UNTERMINATED) == (UNTERMINATED, [])


def test_hermes_mixed_calls_malformed_blocks_and_text() -> None:
    content, calls = HERMES.parse(MIXED)
    # Whitespace around a cut block is kept as written; only a malformed block stays in the content.
    assert content == "  Lead   mid <tool_call>not json</tool_call>\n\n tail  "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"q": "ü <tool_call>"}), ("b", {})]


BETWEEN = "I'll look.\n" + ONE_CALL + "\nThen Oslo:\n" + block("b", {}) + "\n"
GLUED = "a" + ONE_CALL + "b" + block("b", {}) + block("c", {}) + "c"


@pytest.mark.parametrize(("text", "content"), [
    (BETWEEN, "I'll look.\n\nThen Oslo:"),  # text between calls keeps its own whitespace
    (GLUED, "a b c"),  # text glued to a block gets one space there, never merged words
    ("\n  " + ONE_CALL + "  after", "after"),  # whitespace at the content's edges only separated markup
    ("before \n" + ONE_CALL + " \n", "before"),
    (" lead " + ONE_CALL + " \n mid\t" + ONE_CALL + " tail ", " lead  \n mid\t tail "),
])
def test_hermes_content_is_the_text_minus_the_call_blocks(text: str, content: str) -> None:
    parsed_content, calls = HERMES.parse(text)
    assert parsed_content == content
    assert calls and all(c.name for c in calls)
    assert assembled(PARSERS["hermes"], list(text)) == ParsedOutput(content, "", calls)


def test_none_parser_leaves_markup_as_content() -> None:
    assert TOOL_CALL_PARSERS["none"].parse(ONE_CALL) == (ONE_CALL, [])


@pytest.mark.parametrize(("name", "in_prompt", "text", "expected"), [
    ("qwen3", False, THINKING, ("Reason a bit.", "The answer.  ")),
    ("qwen3", False, "No thinking here.", (None, "No thinking here.")),
    ("qwen3", True, "opened by the template</think>After", ("opened by the template", "After")),
    ("deepseek-r1", False, "thought</think>\nanswer", ("thought", "answer")),
    ("deepseek-r1", False, "<think>cut off mid-thou", ("cut off mid-thou", "")),
])
def test_reasoning_split(name: str, in_prompt: bool, text: str, expected: tuple[str | None, str]) -> None:
    parser = REASONING_PARSERS[name]
    assert parser.parse(text, parser.starts_in_reasoning("<|im_start|>assistant\n<think>\n" if in_prompt else
                                                         "<|im_start|>assistant\n")) == expected


def test_unknown_parser_names_list_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="hermes, none"):
        tool_call_parser("mistral")
    with pytest.raises(ValueError, match="deepseek-r1, qwen3"):
        reasoning_parser("nope")
    assert reasoning_parser(None) is None


def test_held_prefix_length() -> None:
    assert held_prefix_length("abc <tool_", "<tool_call>") == 6
    assert held_prefix_length("abc <tool_call>", "<tool_call>") == 0  # a whole tag is not held
    assert held_prefix_length("abc", "<tool_call>") == 0


def assembled(parser: OutputParser, chunks: list[str]) -> ParsedOutput:
    """What a client assembles from the streamed events, in the shape of the non-streaming result."""
    stream = parser.stream()
    events = [event for piece in chunks for event in stream.feed(piece)] + stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert all(e.text for e in events if isinstance(e, ContentDelta | ReasoningDelta))
    return ParsedOutput(content, reasoning, [c.call for c in calls])


def normalised(parsed: ParsedOutput) -> ParsedOutput:
    return ParsedOutput(parsed.content or "", parsed.reasoning or "", parsed.tool_calls)


def chunkings(text: str, rng: random.Random) -> list[list[str]]:
    ways = [[text], list(text)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        ways.append([text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


PARSERS = {
    "hermes": OutputParser(HERMES),
    "hermes+qwen3": OutputParser(HERMES, REASONING_PARSERS["qwen3"]),
    "hermes+deepseek-r1": OutputParser(HERMES, REASONING_PARSERS["deepseek-r1"], in_reasoning=True),
    "qwen3 only": OutputParser(None, REASONING_PARSERS["qwen3"]),
    "one call": OutputParser(HERMES, max_tool_calls=1),
}
TEXTS = [ONE_CALL, TWO_CALLS, CONTENT_FIRST, MALFORMED, UNTERMINATED, MIXED, THINKING,
         THINKING + "\n" + TWO_CALLS, "<thi", "  <think>x</thi", "plain text  \n", BETWEEN, GLUED,
         " \n" + ONE_CALL + " \n" + MALFORMED + ONE_CALL + "x " + UNTERMINATED]


@pytest.mark.parametrize("parser_name", list(PARSERS))
@pytest.mark.parametrize("text", TEXTS)
def test_stream_in_any_chunking_equals_the_whole_parse(parser_name: str, text: str) -> None:
    parser = PARSERS[parser_name]
    expected = normalised(parser.parse(text))
    rng = random.Random(text)
    for chunks in chunkings(text, rng):
        assert assembled(parser, chunks) == expected, chunks


def test_every_two_way_split_of_a_call_with_content_equals_the_whole_parse() -> None:
    parser = PARSERS["hermes+qwen3"]
    text = THINKING + "\n" + MIXED
    expected = normalised(parser.parse(text))
    for cut in range(1, len(text)):
        assert assembled(parser, [text[:cut], text[cut:]]) == expected, cut


@pytest.mark.parametrize("text", [ONE_CALL, CONTENT_FIRST, TWO_CALLS])
def test_stream_never_sends_call_markup_as_content(text: str) -> None:
    stream = PARSERS["hermes"].stream()
    events = [event for piece in text for event in stream.feed(piece)] + stream.finish()
    assert not any("<" in e.text for e in events if isinstance(e, ContentDelta))


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    parsed = PARSERS["one call"].parse(TWO_CALLS)
    assert [c.name for c in parsed.tool_calls] == ["a"]


def test_proxy_config_refuses_unknown_parsers_at_start_up() -> None:
    from pydantic import ValidationError

    from proxy.config import ProxyConfig

    with pytest.raises(ValidationError, match="valid: hermes, none"):
        ProxyConfig(tool_call_parser="pythonic")
    with pytest.raises(ValidationError, match="valid: deepseek-r1, qwen3"):
        ProxyConfig(reasoning_parser="r2")
    assert ProxyConfig().tool_call_parser == "hermes" and ProxyConfig().reasoning_parser is None


OTHER_CALL = block("b", {"k": " v "})


def random_text(rng: random.Random) -> str:
    """Words, whitespace, call blocks and malformed blocks in random order."""
    parts = ["word", "two words", " ", "\n", "\t ", ONE_CALL, OTHER_CALL, "<tool_call>x</tool_call>"]
    return "".join(rng.choice(parts) for _ in range(rng.randint(1, 8)))


@pytest.mark.parametrize("seed", range(40))
def test_random_texts_keep_every_word_and_stream_as_parsed(seed: int) -> None:
    rng = random.Random(seed)
    text = random_text(rng)
    content, calls = HERMES.parse(text)
    without_calls = text.replace(ONE_CALL, " ").replace(OTHER_CALL, " ")
    assert (content or "").split() == without_calls.split()  # nothing lost, no two words merged
    assert len(calls) == text.count(ONE_CALL) + text.count(OTHER_CALL)
    expected = normalised(PARSERS["hermes"].parse(text))
    for chunks in chunkings(text, rng) if len(text) > 1 else [[text]]:
        assert assembled(PARSERS["hermes"], chunks) == expected, chunks
