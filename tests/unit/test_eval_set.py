"""The eval set of gated promotion: JSONL items, refused with the line named when malformed."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewards.evaluation import EvalSetError, item_score, load_eval_set, parse_item
from rewards.hooks.contract import HookResult


def test_items_take_messages_or_a_prompt_and_keep_the_answer_in_metadata(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text(
        '{"id": "q1", "prompt": "2+2?", "answer": "4"}\n'
        "\n"
        '{"messages": [{"role": "user", "content": "hi"}], "task": {"kind": "greet"}}\n'
    )
    first, second = load_eval_set(path)
    assert first.id == "q1" and first.messages == ({"role": "user", "content": "2+2?"},)
    assert first.metadata == {"answer": "4"}
    assert second.id == "3" and second.task == {"kind": "greet"}


def test_limit_keeps_the_first_items(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(5)))
    assert [item.id for item in load_eval_set(path, limit=2)] == ["1", "2"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"answer": "4"}', "`messages` or a `prompt`"),
        ('{"messages": []}', "non-empty list"),
        ('{"prompt": "p", "metadata": 3}', "`metadata` must be an object"),
    ],
)
def test_a_malformed_line_is_named(line: str, message: str) -> None:
    with pytest.raises(EvalSetError, match=message) as caught:
        parse_item(line, 7)
    assert "line 7" in str(caught.value)


def test_an_empty_or_repeating_set_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(EvalSetError, match="no items"):
        load_eval_set(empty)
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(EvalSetError, match="repeats"):
        load_eval_set(twice)
    with pytest.raises(EvalSetError, match="cannot read"):
        load_eval_set(tmp_path / "missing.jsonl")


def test_an_item_is_scored_by_the_session_reward_else_its_completions_else_zero() -> None:
    assert item_score(HookResult(session=0.5, completions={"c": 1.0})) == 0.5
    assert item_score(HookResult(completions={"a": 1.0, "b": 0.0})) == 0.5
    assert item_score(None) == 0.0
    assert item_score(HookResult()) == 0.0
