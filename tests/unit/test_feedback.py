"""The pure parts of user feedback (`POST /rl/v1/feedback`): what a body may hold, what a thumbs counts as,
the feedback config, the feedback rate bucket kept apart from inference's, and the feedback a reward hook
is handed."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, cast

import pydantic
import pytest

from proxy.auth import Principal
from proxy.config import KeyRateLimit, RateLimitsConfig
from proxy.errors import OpenAIError
from proxy.rate_limits import KeyLimiter
from proxy.rl.feedback import feedback_value
from proxy.rl.schemas import MAX_COMMENT_CHARS, FeedbackRequest
from rewards.config import FeedbackConfig, RewardsConfig
from rewards.hooks.contract import FeedbackView
from rewards.inputs import feedback_views
from storage.engine import SessionFactory
from storage.feedback import StoredFeedback


@pytest.mark.parametrize(
    "body",
    [
        {"value": 0.5},
        {"value": -3},
        {"thumbs": "up", "comment": "Nice."},
        {"comment": "Too long."},
        {"completion_id": "chatcmpl-abc-1", "value": 1e6},
        {"completion_id": "resp_abc", "thumbs": "down"},
    ],
)
def test_a_feedback_body_holds_a_value_a_thumbs_or_a_comment(body: dict[str, Any]) -> None:
    parsed = FeedbackRequest.model_validate(body)
    assert parsed.model_dump(exclude_none=True) == body


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({}, "at least one of value, thumbs and comment"),
        ({"completion_id": "chatcmpl-abc"}, "at least one"),
        ({"value": 1.0, "thumbs": "up"}, "not both"),
        ({"value": "1"}, "value"),
        ({"value": True}, "value"),
        ({"value": math.nan}, "value"),
        ({"value": math.inf}, "value"),
        ({"value": -1.5e6}, "value"),
        ({"thumbs": "sideways"}, "thumbs"),
        ({"thumbs": True}, "thumbs"),
        ({"comment": ""}, "comment"),
        ({"comment": "x" * (MAX_COMMENT_CHARS + 1)}, "comment"),
        ({"comment": 5}, "comment"),
        ({"completion_id": "", "value": 1.0}, "completion_id"),
        ({"completion_id": "c" * 65, "value": 1.0}, "completion_id"),
        ({"value": 1.0, "source": "mine"}, "source"),
    ],
)
def test_a_feedback_body_without_one_judgement_or_with_a_wrong_field_is_refused(
    body: dict[str, Any], match: str
) -> None:
    with pytest.raises(pydantic.ValidationError, match=match):
        FeedbackRequest.model_validate(body)


def test_a_thumbs_counts_as_its_configured_value_and_a_comment_alone_as_nothing() -> None:
    config = FeedbackConfig(thumbs_up=0.5, thumbs_down=-2.0)
    assert feedback_value(FeedbackRequest(thumbs="up"), config) == 0.5
    assert feedback_value(FeedbackRequest(thumbs="down", comment="no"), config) == -2.0
    assert feedback_value(FeedbackRequest(value=0.25, comment="ok"), config) == 0.25
    assert feedback_value(FeedbackRequest(comment="hmm"), config) is None
    assert feedback_value(FeedbackRequest(thumbs="up"), FeedbackConfig()) == 1.0


def test_the_feedback_config_refuses_hook_sources_unknown_keys_and_unbounded_values() -> None:
    defaults = RewardsConfig().feedback
    assert (defaults.thumbs_up, defaults.thumbs_down, defaults.source) == (1.0, -1.0, "feedback")
    with pytest.raises(pydantic.ValidationError, match="hook:"):
        FeedbackConfig(source="hook:feedback")
    with pytest.raises(pydantic.ValidationError, match="thumbs_sideways"):
        RewardsConfig.model_validate({"feedback": {"thumbs_sideways": 0.0}})
    with pytest.raises(pydantic.ValidationError, match="thumbs_up"):
        FeedbackConfig(thumbs_up=math.inf)
    with pytest.raises(pydantic.ValidationError, match="thumbs_down"):
        FeedbackConfig(thumbs_down=-1e9)


def test_feedback_calls_spend_a_bucket_of_their_own() -> None:
    config = RateLimitsConfig(
        online=KeyRateLimit(requests_per_s=0.001, burst=1),
        feedback=KeyRateLimit(requests_per_s=0.001, burst=2),
    )
    limiter = KeyLimiter(config, cast(SessionFactory, None))  # no daily quota: the database is never used
    key = Principal("online", None, "hash", key_id=7)
    limiter.admit(key)
    with pytest.raises(OpenAIError) as inference_refused:
        limiter.admit(key)
    assert inference_refused.value.status == 429
    limiter.admit_feedback(key)  # inference spent its bucket, not this one
    limiter.admit_feedback(key)
    with pytest.raises(OpenAIError) as refused:
        limiter.admit_feedback(key)
    assert refused.value.status == 429 and "feedback calls per second" in str(refused.value)
    assert int(refused.value.headers["Retry-After"]) >= 1
    limiter.admit_feedback(Principal("online", None, "other", key_id=8))  # each key its own
    unlimited = KeyLimiter(RateLimitsConfig(feedback=KeyRateLimit()), cast(SessionFactory, None))
    for _ in range(1000):
        unlimited.admit_feedback(key)


def test_hooks_see_a_sessions_feedback_in_arrival_order() -> None:
    created = datetime(2026, 1, 1, tzinfo=UTC)
    stored = [
        StoredFeedback(
            id=1,
            completion_id="c1",
            value=1.0,
            thumbs="up",
            comment=None,
            state="applied",
            created_at=created,
        ),
        StoredFeedback(
            id=2, completion_id="c2", value=None, thumbs=None, comment="meh", state="late", created_at=created
        ),
    ]
    assert feedback_views(stored) == (
        FeedbackView(completion_id="c1", value=1.0, thumbs="up", comment=None),
        FeedbackView(completion_id="c2", value=None, thumbs=None, comment="meh"),
    )
