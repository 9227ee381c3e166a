"""The RL control API (docs/architecture.md, "Wire protocols") and AReaL's compatible /rl routes.

/rl/v1: admin keys create sessions and groups; a session key rewards, ends and reads only its own
session (an ended session's key still works here, not for inference); an admin key does anything,
including listing and revoking keys (`/rl/v1/keys`); users' feedback on completions arrives at
`/rl/v1/feedback`. Bodies are JSON; a body that is not JSON is a 400, a wrong value (a non-numeric, NaN
or infinite reward) a 422, and no refusal writes anything. With `proxy.admission.enabled`, creating
sessions (and groups) past admission control's capacity is a 429 with `Retry-After`
(proxy/rl/admission.py).
"""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from proxy.auth import Principal, bearer_key, require_admin, require_key
from proxy.bodies import openapi_body
from proxy.errors import OpenAIError
from proxy.rl import operations as ops
from proxy.rl.feedback import give_feedback
from proxy.rl.schemas import (
    ArealEndSessionResponse,
    ArealGroupSession,
    ArealMessageResponse,
    ArealSetRewardRequest,
    ArealStartGroupResponse,
    ArealStartSessionRequest,
    ArealStartSessionResponse,
    CreateGroupRequest,
    CreateGroupResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    EndSessionResponse,
    FeedbackRequest,
    FeedbackResponse,
    GroupSession,
    KeyList,
    KeyView,
    PolicyView,
    RewardRequest,
    RewardResponse,
    SessionView,
    VersionSummary,
)
from proxy.services import ProxyServices, get_services
from storage.keys import list_keys
from storage.models import KeyScope, SessionStatus
from storage.policy_versions import best_version, newest_version, served_version

logger = logging.getLogger(__name__)

Services = Annotated[ProxyServices, Depends(get_services)]
Admin = Annotated[Principal, Depends(require_admin)]
Caller = Annotated[Principal, Depends(require_key)]

MAX_KEYS_LISTED = 1000


def build_rl_router() -> APIRouter:
    """The /rl/v1 routes and AReaL's /rl aliases."""
    router = APIRouter()
    # Routes that read their body by hand (`ops.parse_body`, after the key) declare it for the document.
    router.add_api_route("/rl/v1/sessions", create_session, methods=["POST"], status_code=201,
                         openapi_extra=openapi_body(CreateSessionRequest, required=False))
    router.add_api_route("/rl/v1/groups", create_group, methods=["POST"], status_code=201,
                         openapi_extra=openapi_body(CreateGroupRequest))
    router.add_api_route("/rl/v1/sessions/{session_id}", get_session, methods=["GET"])
    router.add_api_route("/rl/v1/sessions/{session_id}/reward", reward_session, methods=["POST"],
                         openapi_extra=openapi_body(RewardRequest))
    router.add_api_route("/rl/v1/completions/{completion_id}/reward", reward_completion, methods=["POST"],
                         openapi_extra=openapi_body(RewardRequest))
    router.add_api_route("/rl/v1/sessions/{session_id}/end", end_session, methods=["POST"])
    router.add_api_route("/rl/v1/feedback", post_feedback, methods=["POST"], status_code=201,
                         openapi_extra=openapi_body(FeedbackRequest))
    router.add_api_route("/rl/v1/policy", get_policy, methods=["GET"])
    router.add_api_route("/rl/v1/keys", list_api_keys, methods=["GET"])
    router.add_api_route("/rl/v1/keys/{key_id}/revoke", revoke_api_key, methods=["POST"])
    router.add_api_route("/rl/start_session", areal_start_session, methods=["POST"], response_model=None,
                         openapi_extra=openapi_body(ArealStartSessionRequest, required=False))
    router.add_api_route("/rl/set_reward", areal_set_reward, methods=["POST"],
                         openapi_extra=openapi_body(ArealSetRewardRequest))
    router.add_api_route("/rl/end_session", areal_end_session, methods=["POST"])
    return router


# /rl/v1


async def create_session(request: Request, _admin: Admin, services: Services) -> CreateSessionResponse:
    body = await ops.parse_body(request, CreateSessionRequest)
    hooks = ops.reward_hooks(services, body.reward, "session")
    session_id, api_key = await ops.start_session(
        services, task=body.task, group_id=body.group_id, metadata=body.metadata, hooks=hooks
    )
    return CreateSessionResponse(session_id=session_id, api_key=api_key, base_url=services.config.base_url())


async def create_group(request: Request, _admin: Admin, services: Services) -> CreateGroupResponse:
    body = await ops.parse_body(request, CreateGroupRequest)
    hooks = ops.reward_hooks(services, body.reward, "session")
    group_hooks = ops.reward_hooks(services, body.group_reward, "group", param="group_reward")
    group_id, members = await ops.start_group(services, size=body.size, task=body.task, hooks=hooks,
                                              group_hooks=group_hooks)
    return CreateGroupResponse(
        group_id=group_id,
        sessions=[GroupSession(session_id=sid, api_key=key) for sid, key in members],
        base_url=services.config.base_url(),
    )


async def get_policy(caller: Caller, services: Services) -> PolicyView:
    """The served policy version (0: the initial weights) and the newest trained one; agents that want
    on-policy samples wait for the served version to advance between rounds."""
    factory = services.session_factory
    served, newest = await served_version(factory), await newest_version(factory)
    best = await best_version(factory)
    return PolicyView(
        policy_version=0 if served is None else served.version,
        served=None if served is None else VersionSummary.model_validate(served.as_json()),
        newest=None if newest is None else VersionSummary.model_validate(newest.as_json()),
        best_version=None if best is None else best.version,
    )


async def get_session(session_id: str, caller: Caller, services: Services) -> SessionView:
    return await ops.describe(services, caller, session_id)


async def reward_session(
    session_id: str, request: Request, caller: Caller, services: Services
) -> RewardResponse:
    body = await ops.parse_body(request, RewardRequest)
    await ops.session_status(services.session_factory, session_id)  # 404 before 403
    return await ops.reward(
        services, caller, session_id=session_id, completion_id=None,
        value=body.value, source=body.source, details=body.details,
    )


async def reward_completion(
    completion_id: str, request: Request, caller: Caller, services: Services
) -> RewardResponse:
    body = await ops.parse_body(request, RewardRequest)
    session_id = await ops.session_of_completion(services.session_factory, completion_id)
    return await ops.reward(
        services, caller, session_id=session_id, completion_id=completion_id,
        value=body.value, source=body.source, details=body.details,
    )


async def end_session(session_id: str, caller: Caller, services: Services) -> EndSessionResponse:
    return await ops.end(services, caller, session_id)


async def post_feedback(request: Request, caller: Caller, services: Services) -> FeedbackResponse:
    """A user's judgement of one completion (docs/online.md): 201 with its state, "applied" (it
    reaches training) or "late" (stored only). 429 past the key's feedback rate
    (`proxy.rate_limits.feedback`), before the body is read."""
    services.limiter.admit_feedback(caller)
    body = await ops.parse_body(request, FeedbackRequest)
    key_hash = caller.key_hash or services.key_hasher.hash(bearer_key(request))
    return await give_feedback(services, caller, key_hash, body)


async def list_api_keys(
    _admin: Admin, services: Services,
    kind: Annotated[Literal["admin", "online", "session"] | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_KEYS_LISTED)] = 100,
) -> KeyList:
    """Stored keys, newest first (`kind` only, when given): id, kind, creation, revocation and session,
    never a key or its hash."""
    keys = await list_keys(services.session_factory, scope=kind, limit=limit + 1)
    return KeyList(data=[ops.key_view(info) for info in keys[:limit]], has_more=len(keys) > limit)


async def revoke_api_key(key_id: str, _admin: Admin, services: Services) -> KeyView:
    """Revoke a key by its id (from `GET /rl/v1/keys`); idempotent, 404 for an unknown id. It takes
    effect at once on this proxy (a successful RL POST clears its key cache) and within
    `proxy.key_cache_ttl_s` on every other proxy of the database, which may still hold the key as
    checked; a call already running finishes. The last unrevoked admin key cannot be revoked (409), so
    an admin key never revokes the API's administration away; create another one first."""
    if not (key_id.isascii() and key_id.isdigit()) or len(key_id) > 18:  # ids are positive 64-bit integers
        raise OpenAIError(404, f"No key {key_id!r}.", "invalid_request_error", code="key_not_found")
    return await ops.revoke(services, int(key_id))


# AReaL's proxy API: thin over the same operations.


def _own_session(principal: Principal) -> str:
    if principal.session_id is None:
        raise OpenAIError(
            403, "This route acts on the caller's own session: use its session API key.",
            "permission_error", code="session_key_required",
        )
    return principal.session_id


async def areal_start_session(
    request: Request, response: Response, _admin: Admin, services: Services
) -> ArealStartSessionResponse | ArealStartGroupResponse:
    """`{task_id, api_key?}` → `{session_id, api_key}`; v2 `{group_size}` → 201 `{group_id, sessions}`.
    A client-chosen key must be long and varied enough (`ops.check_client_key`, else 400). A reused key
    whose session is still active ends and finalizes that session first; a revoked one is a 409."""
    body = await ops.parse_body(request, ArealStartSessionRequest)
    if body.group_size is not None:
        group_id, members = await ops.start_group(
            services, size=body.group_size, task=body.task_id,
            hooks=ops.reward_hooks(services, None, "session"),
            group_hooks=ops.reward_hooks(services, None, "group"),
        )
        response.status_code = 201
        return ArealStartGroupResponse(
            group_id=group_id,
            sessions=[ArealGroupSession(session_id=sid, session_api_key=key) for sid, key in members],
        )
    if body.api_key is None:
        session_id, api_key = await ops.start_session(
            services, task=body.task_id, group_id=None, metadata={},
            hooks=ops.reward_hooks(services, None, "session"),
        )
        return ArealStartSessionResponse(session_id=session_id, api_key=api_key)
    ops.check_client_key(body.api_key)
    owner = await ops.stored_key(services, body.api_key)
    if owner is None:
        session_id, api_key = await ops.start_session(
            services, task=body.task_id, group_id=None, metadata={}, api_key=body.api_key,
            hooks=ops.reward_hooks(services, None, "session"),
        )
        return ArealStartSessionResponse(session_id=session_id, api_key=api_key)
    old_session = owner.session_id
    if owner.scope != KeyScope.SESSION.value or old_session is None:
        raise OpenAIError(
            400, "Cannot use an admin or online API key as a session key.", "invalid_request_error",
            param="api_key",
        )
    if owner.revoked:
        raise ops.revoked_key_error()
    if await ops.session_status(services.session_factory, old_session) != SessionStatus.FINALIZED.value:
        await ops.end_and_finalize(services, old_session)  # before its key moves on
    session_id = await ops.rebind_key(services, owner, task=body.task_id)
    return ArealStartSessionResponse(session_id=session_id, api_key=body.api_key)


async def areal_set_reward(request: Request, caller: Caller, services: Services) -> ArealMessageResponse:
    """`{reward, interaction_id?}` → `{message}`: a reward on a completion of the caller's session,
    its last completion when `interaction_id` is null."""
    body = await ops.parse_body(request, ArealSetRewardRequest)
    session_id = _own_session(caller)
    completion_id = body.interaction_id
    if completion_id is None:
        completion_id = await ops.last_completion_id(services.session_factory, session_id)
        if completion_id is None:
            raise OpenAIError(
                400, f"Session {session_id} has no completions to reward.", "invalid_request_error",
                param="interaction_id", code="no_interactions",
            )
    owner = await ops.session_of_completion(services.session_factory, completion_id)
    await ops.reward(
        services, caller, session_id=owner, completion_id=completion_id,
        value=body.reward, source="rest", details={},
    )
    return ArealMessageResponse(message="success")


async def areal_end_session(caller: Caller, services: Services) -> ArealEndSessionResponse:
    """`{}` → `{message, interaction_count}`: ends and finalizes the caller's session now; rewards
    never set count as 0 (AReaL's rule)."""
    session_id = _own_session(caller)
    await ops.end(services, caller, session_id, finalize_now=True)
    count = await ops.completion_count(services.session_factory, session_id)
    return ArealEndSessionResponse(message="success", interaction_count=count)
