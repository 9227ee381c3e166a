"""The dashboard's pure pieces: how sessions are labelled by run and task, reward curves and the reward
filter (rewards combined as the finalizer combines them), staleness buckets, the sessions cursor, token
columns, and answers that stay JSON whatever floats they carry."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any, cast

import numpy as np
import pytest

from proxy.dashboard.charts import lag_buckets, reward_series_json
from proxy.dashboard.documents import DashboardJSON, reward_range
from proxy.dashboard.params import aware, decode_cursor, encode_cursor, text_param
from proxy.dashboard.sessions import token_columns
from proxy.errors import OpenAIError
from proxy.tokenize import ChatTokenizer
from storage.dashboard.labels import TASK_TEXT_CHARS, run_label, task_label
from storage.dashboard.rewards import RewardedSession
from storage.dashboard.sessions import PagePosition
from storage.dashboard.sql import chunks
from storage.ops_queries import StoredRewardValue
from storage.queries import baseline_key
from tests.support.operated_run import completion

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def rest(value: float, completion_id: str | None = None, source: str = "rest") -> StoredRewardValue:
    return StoredRewardValue(value=value, source=source, completion_id=completion_id)


def rewarded(
    sid: str, run: str | None, task: Any, minute: int, *rewards: StoredRewardValue
) -> RewardedSession:
    return RewardedSession(id=sid, status="ended", run=run, task=task_label(task),
                           at=T0 + timedelta(minutes=minute), rewards=rewards)


@pytest.mark.parametrize(("task", "text"), [
    ("What is 2+2?", "What is 2+2?"),
    ({"id": "gsm8k-17", "question": "How many?"}, "gsm8k-17"),
    ({"question": "How   many\napples?"}, "How many apples?"),
    ({"task_id": 7}, "7"),
    ({"rows": [1, 2]}, '{"rows":[1,2]}'),
    (42, "42"),
])
def test_a_task_is_named_briefly_and_keyed_as_the_trainer_keys_it(task: Any, text: str) -> None:
    label = task_label(task)
    assert label is not None
    assert (label.text, label.key) == (text, baseline_key(task, None))


def test_a_long_task_is_cut_and_no_task_has_no_label() -> None:
    label = task_label("x" * 500)
    assert label is not None and len(label.text) == TASK_TEXT_CHARS and label.text.endswith("…")
    assert task_label(None) is None


def test_a_run_label_is_text() -> None:
    assert [run_label(m) for m in ({"run": "a"}, {"run": 3}, {}, None)] == ["a", "3", None, None]


def test_reward_curves_combine_rewards_and_keep_the_busiest_series() -> None:
    sessions = [
        rewarded("a-1", "a", "t1", 0, rest(1.0), rest(0.5, source="hook:math")),  # the client's wins
        rewarded("b-1", "b", "t1", 1, rest(0.25), rest(0.5, "c1")),  # session + completion reward
        rewarded("a-2", "a", "t2", 2, rest(0.0), rest(2.0)),  # the latest value of one source counts
        rewarded("c-1", "c", "t3", 3, rest(0.5, "c2", source="hook:math")),
        rewarded("a-3", "a", "t2", 4),  # no reward: no point
    ]
    curves = reward_series_json(sessions, "rest_wins", "run", max_series=2)
    assert [(s["key"], s["sessions"], s["rewards"]) for s in curves["series"]] == [
        ("a", ["a-1", "a-2"], [1.0, 2.0]), ("b", ["b-1"], [0.75])]
    assert (curves["points"], curves["other_series"]) == (3, 1)
    assert curves["series"][0]["times"] == [T0.timestamp(), (T0 + timedelta(minutes=2)).timestamp()]
    assert (curves["series"][0]["mean"], curves["series"][0]["last"]) == (1.5, 2.0)

    summed = reward_series_json(sessions, "sum", "task", max_series=10)
    by_label = {s["label"]: s["rewards"] for s in summed["series"]}
    assert by_label == {"t1": [1.5, 0.75], "t2": [2.0], "t3": [0.5]}


def test_the_reward_filter_is_inclusive_and_skips_unrewarded_sessions() -> None:
    assert reward_range("rest_wins", None, None) is None
    within = reward_range("rest_wins", 0.0, 1.0)
    assert within is not None
    cases = ([rest(0.0)], [rest(1.0)], [rest(1.5)], [], [rest(0.5), rest(0.75, "c")])
    assert [within(r) for r in cases] == [True, True, False, False, False]
    at_least = reward_range("hooks_win", 1.0, None)
    assert at_least is not None and at_least([rest(0.0), rest(1.0, source="hook:x")])


def test_lags_are_bucketed_with_zeros_and_a_capped_last_bucket() -> None:
    assert lag_buckets({}, 4) == []
    assert lag_buckets({0: 2, 2: 1}, 4) == [
        {"lag": 0, "count": 2}, {"lag": 1, "count": 0}, {"lag": 2, "count": 1}]
    assert lag_buckets({1: 1, 4: 2, 9: 3}, 4)[-2:] == [
        {"lag": 3, "count": 0}, {"lag": 4, "count": 5, "or_more": True}]


def test_the_sessions_cursor_round_trips_and_refuses_anything_else() -> None:
    position = PagePosition(created_at=datetime(2026, 5, 1, 12, 0, 0, 123456, tzinfo=UTC), id="sess/ü?&=")
    cursor = encode_cursor(position)
    assert cursor is not None and cursor.isascii() and "=" not in cursor
    assert decode_cursor(cursor) == position
    assert encode_cursor(None) is None and decode_cursor(None) is None and decode_cursor("") is None
    for bad in ("nope", cursor[:-3], "WzFd", "WyJ4IiwgMV0"):  # not base64 JSON, cut, `[1]`, `["x", 1]`
        with pytest.raises(OpenAIError) as refused:
            decode_cursor(bad)
        assert (refused.value.status, refused.value.param) == (400, "cursor")


def test_times_are_utc_and_text_filters_hold_no_nul() -> None:
    assert aware(datetime(2026, 1, 1, 12)) == datetime(2026, 1, 1, 12, tzinfo=UTC)
    assert aware(datetime(2026, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))) == datetime(
        2026, 1, 1, 10, tzinfo=UTC)
    with pytest.raises(OpenAIError) as refused:
        aware(datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))), "since")
    assert (refused.value.status, refused.value.param) == (400, "since")
    assert text_param("run-1", "run") == "run-1"
    with pytest.raises(OpenAIError):
        text_param("a\x00b", "run")


class _Tokenizer:
    """What token_columns needs of the proxy's tokenizer: a vocabulary of 200 ids, each one's text."""

    vocab_size = 200

    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"


def test_token_columns_carry_the_stored_values_exactly() -> None:
    c = completion("c", "s", None, [1], [3, 3, 4, 4, 4])
    logprobs = np.asarray(c.output_logprobs, dtype=np.float32)
    tokenizer = cast(ChatTokenizer, _Tokenizer())
    whole = token_columns(tokenizer, c, 0, 100)
    assert (whole["ids"], whole["versions"], whole["total"], whole["truncated"]) == (
        [100, 101, 102, 103, 104], [3, 3, 4, 4, 4], 5, False)
    assert np.array_equal(np.array(json.loads(json.dumps(whole["logprobs"])), dtype=np.float32), logprobs)
    assert whole["texts"] == ["<100>", "<101>", "<102>", "<103>", "<104>"]
    page = token_columns(tokenizer, c, 3, 10)
    assert (page["offset"], page["ids"], page["truncated"]) == (3, [103, 104], True)
    assert token_columns(tokenizer, c, 9, 10)["ids"] == []

    unknown = replace(completion("u", "s", None, [1], [0, 0, 0]), output_ids=[5, 500, -1],
                      output_logprobs=np.array([np.nan, -np.inf, -1.0], dtype=np.float32))
    odd = token_columns(tokenizer, unknown, 0, 10)
    assert (odd["texts"], odd["logprobs"]) == (["<5>", None, None], [None, None, -1.0])


def test_answers_are_json_with_null_for_non_finite_numbers() -> None:
    body = DashboardJSON({"a": math.nan, "b": [math.inf, -math.inf, 1.5]}).body
    assert json.loads(body) == {"a": None, "b": [None, None, 1.5]}


def test_ids_are_cut_into_in_lists_of_bounded_size() -> None:
    assert [list(c) for c in chunks(list(range(7)), 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(chunks([], 3)) == []
