"""Pure pieces of token-exact multi-turn conversations: message keys, prefix matching in a session tree,
and suffix rendering (plain ChatML and a Qwen3-style template that rewrites history)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.conversations.text import (
    SuffixError,
    canonical_arguments,
    closed_length,
    message_key,
    render_suffix,
    tools_key,
)
from proxy.conversations.tree import SessionTree
from proxy.tokenize import ChatTokenizer, load_chat_tokenizer
from storage.records import CompletionRecord
from tests.support.qwen3_template import QWEN3_STYLE_TEMPLATE

_ids = itertools.count()


@pytest.fixture(name="tokenizer", scope="module")
def tokenizer_fixture(tiny_model_dir: Path) -> ChatTokenizer:
    return load_chat_tokenizer(tiny_model_dir, None)


def call(name: str, arguments: Any, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


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
    assert canonical_arguments("not json") == "not json"
    assert tools_key(None) is None and tools_key([]) is None
    assert tools_key([{"b": 1, "a": 2}]) == tools_key([{"a": 2, "b": 1}])


def test_closed_length_finds_the_end_of_turn_already_generated() -> None:
    assert closed_length([5, 6, 99], [99, 7]) == 1
    assert closed_length([5, 6], [99, 7]) == 0  # cut off by length: the whole end of turn follows
    assert closed_length([5, 99, 7], [99, 7]) == 2
    assert closed_length([], [99, 7]) == 0


def record(
    messages: list[dict[str, Any]], answer: dict[str, Any], parent: str | None = None,
    tools: list[dict[str, Any]] | None = None, prompt: list[int] | None = None,
    output: list[int] | None = None,
) -> CompletionRecord:
    output = output or [7, 8]
    request: dict[str, Any] = {"messages": messages}
    if tools:
        request["tools"] = tools
    return CompletionRecord(
        id=f"chatcmpl-{next(_ids)}", session_id="s", parent_id=parent, prompt_ids=prompt or [1, 2],
        output_ids=output, output_logprobs=[0.0] * len(output), output_versions=[0] * len(output),
        finish_reason="stop", temperature=1.0, top_p=1.0, top_k=-1, request_json=request,
        response_json={"choices": [{"index": 0, "message": answer}]},
    )


USER = {"role": "user", "content": "hi"}
CALL = {"role": "assistant", "content": None, "tool_calls": [call("f", '{"x": 1}')]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
FINAL = {"role": "assistant", "content": "It is 42."}
SUMMARY = {"role": "user", "content": "Summarize."}


def keys(messages: list[dict[str, Any]]) -> list[Any]:
    return [message_key(m) for m in messages]


def test_the_deepest_extended_completion_is_chosen_and_rebuilt_from_suffixes() -> None:
    tree = SessionTree()
    first = record([USER], CALL, prompt=[1, 2], output=[3])
    second = record([RESULT], FINAL, parent=first.id, prompt=[4], output=[5, 6])
    assert tree.add_all([second, first])  # parents first whatever the order given

    follow_up = [USER, {**CALL, "tool_calls": [call("f", {"x": 1}, "client-id")]}, RESULT, FINAL,
                 {"role": "user", "content": "thanks"}]
    node = tree.deepest_prefix(None, keys(follow_up))
    assert node is not None and node.id == second.id
    assert node.full_ids() == [1, 2, 3, 4, 5, 6]
    assert tree.deepest_prefix(None, keys(follow_up[:3])).id == first.id  # type: ignore[union-attr]
    assert tree.deepest_prefix(None, keys([USER])) is None  # nothing new after a completion: no parent
    assert tree.deepest_prefix(None, keys(follow_up[:2])) is None  # answer without a new message
    edited = [{"role": "user", "content": "hello"}, *follow_up[1:]]
    assert tree.deepest_prefix(None, keys(edited)) is None
    assert tree.deepest_prefix(tools_key([{"type": "function"}]), keys(follow_up)) is None  # other tools
    assert tree.is_branch(None, keys(follow_up[:2])) and not tree.is_branch(None, keys(edited))
    assert not tree.is_branch(None, keys([USER]))  # the first turn asked again: a resample
    assert not tree.is_branch(None, keys(follow_up[:3]))  # the second turn asked again


def test_only_unknown_assistant_messages_call_for_a_reload() -> None:
    tree = SessionTree()
    tree.add(record([USER], CALL))
    assert not tree.may_be_stale_for(keys([USER, CALL, RESULT]))  # every answer known
    assert not tree.may_be_stale_for(keys([{"role": "user", "content": "other"}]))
    unknown = [USER, CALL, RESULT, FINAL, SUMMARY]
    assert tree.may_be_stale_for(keys(unknown))  # FINAL may have been recorded by another proxy
    tree.note_foreign(keys(unknown))
    assert not tree.may_be_stale_for(keys(unknown))  # a reload did not find it: never reload for it again


def test_a_child_of_an_unknown_parent_is_refused() -> None:
    tree = SessionTree()
    assert not tree.add(record([RESULT], FINAL, parent="chatcmpl-gone"))
    assert tree.add(record([], FINAL)) and not tree.nodes  # not a chat request: ignored
    assert not tree.add_all([record([RESULT], FINAL, parent="chatcmpl-gone")])


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


def test_full_ids_are_int_lists() -> None:
    tree = SessionTree()
    first = record([USER], FINAL, prompt=[1], output=[2])
    tree.add(first)
    assert tree.nodes[first.id].full_ids() == [1, 2]
    assert isinstance(tree.nodes[first.id].prompt_ids, np.ndarray)


def test_a_busy_session_forgets_its_oldest_finished_turns() -> None:
    tree = SessionTree(max_nodes=3)
    first = record([USER], CALL)
    second = record([RESULT], FINAL, parent=first.id)
    others = [record([{"role": "user", "content": f"q{i}"}], FINAL) for i in range(2)]
    assert tree.add_all([first, second, *others])

    assert list(tree.nodes) == [first.id, others[0].id, others[1].id]  # the oldest leaf went first
    assert tree.nodes[first.id].children == 0  # its child is gone: it is a leaf now
    assert tree.deepest_prefix(None, keys([USER, CALL, RESULT, FINAL, SUMMARY])).id == first.id  # type: ignore[union-attr]
    assert not tree.add(record([SUMMARY], FINAL, parent=second.id))  # a child of a forgotten node
