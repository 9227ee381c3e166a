"""proxy/conversations/text.py: message keys (what makes two messages the same turn), the end of turn
already generated, and suffix rendering (plain ChatML and a Qwen3-style template that rewrites
history)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.conversations.text import SuffixError, closed_length, render_suffix
from proxy.tokenize import ChatTokenizer, load_chat_tokenizer
from rewards.message_keys import canonical_arguments, message_key, tools_key
from tests.support.chat_conversation import CALL, RESULT, USER, call
from tests.support.qwen3_template import QWEN3_STYLE_TEMPLATE


@pytest.fixture(name="tokenizer", scope="module")
def tokenizer_fixture(tiny_model_dir: Path) -> ChatTokenizer:
    return load_chat_tokenizer(tiny_model_dir, None)


def test_keys_ignore_ids_and_reasoning_and_compare_parsed_arguments() -> None:
    sent = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"a": 1, "b": [2]}', "call_x")],
            "reasoning_content": "hmm"}
    echoed = {"role": "assistant", "content": "", "tool_calls": [call("f", {"b": [2], "a": 1}, "rewritten")]}
    assert message_key(sent) == message_key(echoed)
    assert message_key({"role": "tool", "tool_call_id": "a", "content": "4"}) == message_key(
        {"role": "tool", "tool_call_id": "b", "content": "4", "name": "f"}
    )
    assert message_key(echoed) != message_key({**echoed, "tool_calls": [call("f", {"a": 2, "b": [2]})]})
    assert message_key(echoed) != message_key({**echoed, "tool_calls": [call("g", {"a": 1, "b": [2]})]})
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert message_key(parts) == message_key({"role": "user", "content": "a\nb"})
    assert message_key({"role": "user", "content": "x"}) != message_key({"role": "system", "content": "x"})
    # An agent that strips the answers it sends back (hermes-agent) still extends them; users' text is kept.
    assert message_key({"role": "assistant", "content": " Hi there.\n"}) == message_key(
        {"role": "assistant", "content": "Hi there."}
    )
    assert message_key({"role": "user", "content": " x"}) != message_key({"role": "user", "content": "x"})
    assert canonical_arguments("not json") == "not json"
    assert tools_key(None) is None and tools_key([]) is None
    assert tools_key([{"b": 1, "a": 2}]) == tools_key([{"a": 2, "b": 1}])


def test_closed_length_finds_the_end_of_turn_already_generated() -> None:
    assert closed_length([5, 6, 99], [99, 7]) == 1
    assert closed_length([5, 6], [99, 7]) == 0  # cut off by length: the whole end of turn follows
    assert closed_length([5, 99, 7], [99, 7]) == 2
    assert closed_length([], [99, 7]) == 0


def encode(tokenizer: ChatTokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def test_suffix_equals_a_fresh_render_on_a_plain_template(tokenizer: ChatTokenizer) -> None:
    history = [{"role": "system", "content": "Be brief."}, USER]
    answer = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    end = tokenizer.encode("<|im_end|>")
    prompt = tokenizer.render(history, None)
    output = [*tokenizer.encode(answer), *end]
    new = [RESULT, {"role": "user", "content": "and now?"}]

    suffix = render_suffix(tokenizer, output, new, None)

    scratch = tokenizer.render([*history, {**CALL, "tool_calls": [call("f", {"x": 1})]}, *new], None)
    assert [*prompt, *output, *suffix] == scratch
    assert suffix == encode(tokenizer, "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                                       "<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n")
    cut = render_suffix(tokenizer, tokenizer.encode(answer), new, None)  # stopped by length
    assert cut == [*end, *suffix]


def test_suffix_never_depends_on_a_template_rewriting_history(tiny_model_dir: Path) -> None:
    tokenizer = load_chat_tokenizer(tiny_model_dir, None)
    tokenizer.tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    history = [USER]
    output = [*tokenizer.encode("<think>\nlet me see\n</think>\n\nIt is 42.<|im_end|>")]
    new = [{"role": "user", "content": "why?"}]

    suffix = render_suffix(tokenizer, output, new, None)

    assert suffix == tokenizer.encode("\n<|im_start|>user\nwhy?<|im_end|>\n<|im_start|>assistant\n")
    chained = [*tokenizer.render(history, None), *output, *suffix]
    scratch = tokenizer.render([*history, {"role": "assistant", "content": "It is 42."}, *new], None)
    assert chained != scratch  # a fresh render would have dropped the <think> block the model saw
    assert "<think>" in tokenizer.decode(chained, skip_special_tokens=False)


def test_a_template_that_hides_assistant_content_is_refused(tiny_model_dir: Path) -> None:
    tokenizer = load_chat_tokenizer(tiny_model_dir, None)
    tokenizer.tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    with pytest.raises(SuffixError):
        render_suffix(tokenizer, [1], [USER], None)
