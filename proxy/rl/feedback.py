"""User feedback on completions (`POST /rl/v1/feedback`, docs/online.md): which completion it is
on, who may give it and what it counts as. storage/feedback.py stores it, and its reward where it is in
time, in one transaction; here it is held under the session's finalizer guard, as REST rewards are, so a
finalization in this process sees a reward written before it."""

from __future__ import annotations

import logging

from proxy.auth import Principal
from proxy.errors import OpenAIError
from proxy.rl import operations as ops
from proxy.rl.schemas import FeedbackRequest, FeedbackResponse
from proxy.services import ProxyServices
from rewards.config import FeedbackConfig
from storage.feedback import FeedbackEntry, latest_owned_completion, record_feedback
from storage.models import SessionStatus

logger = logging.getLogger(__name__)


def feedback_value(body: FeedbackRequest, config: FeedbackConfig) -> float | None:
    """What a feedback counts as: its value, or its thumbs' configured value; None for a comment alone."""
    if body.thumbs == "up":
        return config.thumbs_up
    if body.thumbs == "down":
        return config.thumbs_down
    return body.value


async def latest_completion(services: ProxyServices, principal: Principal) -> str:
    """The completion a feedback without `completion_id` is on: an online key's newest in the sessions it
    owns, a session key's newest in its session. 422 for an admin key (it must name one), 404 when the
    key has no completion yet."""
    if principal.is_admin:
        raise OpenAIError(
            422,
            "An admin API key must name the completion: give 'completion_id'.",
            "invalid_request_error",
            param="completion_id",
            code="missing_required_parameter",
        )
    if principal.scope == "online" and principal.key_hash is not None:
        found = await latest_owned_completion(services.session_factory, principal.key_hash)
    elif principal.session_id is not None:  # a session key
        found = await ops.last_completion_id(services.session_factory, principal.session_id)
    else:
        found = None
    if found is None:
        raise OpenAIError(
            404,
            "This API key has made no completion to give feedback on.",
            "invalid_request_error",
            param="completion_id",
            code="completion_not_found",
        )
    return found


async def give_feedback(
    services: ProxyServices, principal: Principal, key_hash: str, body: FeedbackRequest
) -> FeedbackResponse:
    """Store one feedback of the key whose hash is `key_hash` (see the module docstring): 404 for an
    unknown completion, 403 for one of a session the key may not act on."""
    completion_id = body.completion_id or await latest_completion(services, principal)
    session_id = await ops.session_of_completion(services.session_factory, completion_id)
    await ops.check_may_act(services, principal, session_id, "completion")
    config = services.rewards.feedback
    entry = FeedbackEntry(
        completion_id=completion_id,
        session_id=session_id,
        key_hash=key_hash,
        value=feedback_value(body, config),
        thumbs=body.thumbs,
        comment=body.comment,
        source=config.source,
    )
    finalizer = services.finalizer
    async with finalizer.session_guard(session_id):
        outcome = await record_feedback(services.session_factory, entry)
    if outcome.session_status == SessionStatus.ENDED.value and outcome.reward_id is not None:
        finalizer.schedule(session_id)  # the reward may make it ready
    services.metrics.feedback.labels(outcome.state).inc()
    logger.info(
        "feedback %d on completion %s (session %s, %s): %s",
        outcome.feedback_id,
        completion_id,
        session_id,
        outcome.session_status,
        outcome.state,
    )
    return FeedbackResponse(
        feedback_id=outcome.feedback_id,
        completion_id=completion_id,
        session_id=session_id,
        state=outcome.state,
        reward_id=outcome.reward_id,
    )
