"""The RL control operations shared by the /rl/v1 routes and AReaL's /rl aliases: create sessions and
groups, attach rewards, end sessions, describe them. Every refusal is an OpenAIError raised before
anything is written."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from sqlalchemy import func, select, update

from proxy.auth import SESSION_KEY_PREFIX, Principal, generate_api_key, may_act_on
from proxy.bodies import body_too_large, decoded_json, json_size, read_body
from proxy.config import LimitsConfig
from proxy.errors import OpenAIError, describe_validation_errors
from proxy.rl.admission import admission_control
from proxy.rl.schemas import (
    CompletionSummary,
    EndSessionResponse,
    FeedbackSummary,
    HookJobView,
    KeyView,
    RewardResponse,
    RewardSummary,
    SessionView,
)
from proxy.services import ProxyServices
from proxy.sessions import new_group_id, new_session_id
from rewards.hooks.adapters import HookConfigError
from rewards.hooks.contract import HookLevel
from rewards.hooks.spec import HookSpec, parse_specs, stored_hooks
from rewards.snapshot import load_session_snapshot
from storage.admission import admit
from storage.engine import SessionFactory, affected_rows, write_transaction
from storage.keys import FoundKey, KeyInfo, LastAdminKeyError, find_key, revoke_key
from storage.models import ApiKey, Completion, KeyScope, Session, SessionStatus, as_utc
from storage.queries import (
    SessionFinalizedError,
    add_reward,
    create_group,
    create_session,
    end_session,
)
from storage.records import CompletionRecord, GroupRecord, SessionRecord
from storage.reward_jobs import jobs_of_session

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)


FREE_JSON_FIELDS = ("task", "task_id", "metadata", "details")
"""Fields of RL bodies that take any JSON and are stored as it is: bounded by
`proxy.limits.max_rl_json_bytes`."""


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body as `model`, read under the body limit (proxy/bodies.py; the route's key was checked
    first): 413 past the limit, 400 if it is not JSON (or nests too deeply, or holds a lone surrogate or
    a NUL), 422 if it is JSON with a wrong value, 413 for a free-form field (`FREE_JSON_FIELDS`) larger
    than `proxy.limits.max_rl_json_bytes`. Python's parser reads the NaN/Infinity literals many clients
    send, so they reach validation as a 422."""
    limits: LimitsConfig = request.app.state.services.config.limits
    raw = await read_body(request, limits.max_body_bytes)
    data: Any = decoded_json(raw, limits.max_json_depth, non_finite=True) if raw.strip() else {}
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        message, param, code = describe_validation_errors(exc.errors())
        raise OpenAIError(422, message, "invalid_request_error", param=param, code=code) from None
    for name in FREE_JSON_FIELDS:
        if name in type(body).model_fields:
            _check_free_json(name, getattr(body, name), limits.max_rl_json_bytes)
    return body


def _check_free_json(name: str, value: Any, max_bytes: int) -> None:
    """422 for NaN or an infinity (not JSON, so not storable), 413 past `max_bytes`."""
    try:
        size = json_size(value)
    except ValueError:
        raise OpenAIError(
            422, f"Invalid value for '{name}': NaN and infinities are not JSON.", "invalid_request_error",
            param=name, code="invalid_value",
        ) from None
    if size > max_bytes:
        raise body_too_large(max_bytes, param=name, what=f"'{name}'")


async def check_may_act(
    services: ProxyServices, principal: Principal, session_id: str, what: str = "session"
) -> None:
    if await may_act_on(services.session_factory, principal, session_id):
        return
    raise OpenAIError(
        403, f"This API key may not act on that {what}: a session key acts only on its own session.",
        "permission_error", code="wrong_session",
    )


def _not_found(kind: str, ident: str) -> OpenAIError:
    return OpenAIError(404, f"No {kind} {ident!r}.", "invalid_request_error", code=f"{kind}_not_found")


def reward_hooks(
    services: ProxyServices, requested: HookSpec | list[HookSpec] | None, level: HookLevel,
    param: str = "reward",
) -> list[dict[str, Any]] | None:
    """The hooks a new session (or group) is labelled by, as stored on its row: those it names, else the
    configured ones. 400 for a hook that cannot be used (unknown, with the nearest name; bad arguments)."""
    rewards = services.rewards
    if requested is None:
        specs = rewards.group_hooks if level == "group" else rewards.hooks
    else:
        specs = parse_specs(requested)
    try:
        services.hooks.check(specs, level)
    except HookConfigError as exc:
        raise OpenAIError(
            400, str(exc), "invalid_request_error", param=param, code="invalid_reward_hook"
        ) from None
    return stored_hooks(specs, rewards.runner.max_attempts)


async def start_session(
    services: ProxyServices, *, task: Any, group_id: str | None, metadata: dict[str, Any],
    api_key: str | None = None, hooks: list[dict[str, Any]] | None = None,
) -> tuple[str, str]:
    """A new session and its key (`api_key` if given, else a fresh one), labelled by `hooks` once it ends
    (`reward_hooks`); 429 past admission control's capacity (proxy/rl/admission.py), 404 for an unknown
    group, 409 for a full one."""
    session_id, key = new_session_id(), api_key or generate_api_key(SESSION_KEY_PREFIX)
    record = SessionRecord(
        id=session_id, key_hash=services.key_hasher.hash(key), group_id=group_id, task=task,
        metadata=metadata, reward_hooks=hooks, admitted=True,
    )
    try:
        with admission_control(services.config.admission, services.metrics, "session") as gate:
            await create_session(services.session_factory, record, admits=gate)
    except LookupError:
        raise _not_found("group", group_id or "") from None
    except ValueError as exc:
        raise OpenAIError(409, str(exc), "conflict_error", param="group_id", code="group_full") from None
    logger.info("session %s started (group %s)", session_id, group_id)
    return session_id, key


async def start_group(
    services: ProxyServices, *, size: int, task: Any, hooks: list[dict[str, Any]] | None = None,
    group_hooks: list[dict[str, Any]] | None = None,
) -> tuple[str, list[tuple[str, str]]]:
    """A group and all `size` of its sessions, in one transaction: each session labelled by `hooks`, the
    group by `group_hooks` once all have ended. 429 past admission control's capacity, where the group
    counts `size` sessions."""
    group_id = new_group_id()
    members = [(new_session_id(), generate_api_key(SESSION_KEY_PREFIX)) for _ in range(size)]
    records = [
        SessionRecord(id=sid, key_hash=services.key_hasher.hash(key), group_id=group_id, task=task,
                      reward_hooks=hooks, admitted=True)
        for sid, key in members
    ]
    group = GroupRecord(id=group_id, size=size, task=task, reward_hooks=group_hooks)
    with admission_control(services.config.admission, services.metrics, "group") as gate:
        await create_group(services.session_factory, group, records, admits=gate)
    logger.info("group %s started with %d sessions", group_id, size)
    return group_id, members


async def session_status(session_factory: SessionFactory, session_id: str) -> str:
    async with session_factory() as db:
        status = await db.scalar(select(Session.status).where(Session.id == session_id))
    if status is None:
        raise _not_found("session", session_id)
    return status


async def session_of_completion(session_factory: SessionFactory, completion_id: str) -> str:
    async with session_factory() as db:
        session_id = await db.scalar(select(Completion.session_id).where(Completion.id == completion_id))
    if session_id is None:
        raise _not_found("completion", completion_id)
    return session_id


async def reward(
    services: ProxyServices, principal: Principal, *, session_id: str, completion_id: str | None,
    value: float, source: str, details: dict[str, Any],
) -> RewardResponse:
    """Attach a reward to a session (`completion_id` None) or to one of its completions. 409 once the
    session is finalized: its trajectories are written and the reward could no longer count."""
    await check_may_act(services, principal, session_id, "completion" if completion_id else "session")
    finalizer = services.finalizer
    async with finalizer.session_guard(session_id):
        status = await session_status(services.session_factory, session_id)
        try:
            if status == SessionStatus.FINALIZED.value:
                raise SessionFinalizedError(session_id)
            # Checked again where it is written: another proxy may finalize the session meanwhile.
            reward_id = await add_reward(
                services.session_factory, value, session_id=None if completion_id else session_id,
                completion_id=completion_id, source=source, details=details,
            )
        except SessionFinalizedError:
            raise OpenAIError(
                409, f"Session {session_id} is finalized: its trajectories are written, so rewards must "
                "arrive before then (before its end, or before its last missing reward).",
                "conflict_error", code="session_finalized",
            ) from None
    if status == SessionStatus.ENDED.value:
        finalizer.schedule(session_id)
    return RewardResponse(
        reward_id=reward_id, session_id=session_id, completion_id=completion_id, value=value, source=source
    )


async def end(
    services: ProxyServices, principal: Principal, session_id: str, *, finalize_now: bool = False
) -> EndSessionResponse:
    """End a session (idempotent) and finalize it when it is ready (`finalize_now`: whatever rewards
    it has, as AReaL does)."""
    await check_may_act(services, principal, session_id)
    finalizer = services.finalizer
    try:
        ended = await end_session(services.session_factory, session_id)
    except LookupError:
        raise _not_found("session", session_id) from None
    status = SessionStatus.ENDED.value
    if not ended:
        status = await session_status(services.session_factory, session_id)
    elif services.hook_runner is not None:
        services.hook_runner.wake()  # its hooks' jobs were queued with its end
    if status == SessionStatus.ENDED.value:
        finalizer.schedule(session_id, now=finalize_now)
    if ended:
        logger.info("session %s ended", session_id)
    return EndSessionResponse(session_id=session_id, status=status, ended=ended)


async def end_and_finalize(services: ProxyServices, session_id: str) -> int:
    """End a session if it is still active and finalize it now, waiting for it (AReaL's key reuse)."""
    if await end_session(services.session_factory, session_id):
        logger.info("session %s ended: its key is reused", session_id)
        if services.hook_runner is not None:
            services.hook_runner.wake()
    return await services.finalizer.finalize(session_id)


async def describe(services: ProxyServices, principal: Principal, session_id: str) -> SessionView:
    await check_may_act(services, principal, session_id)
    # Jobs first: a job settles in the transaction that writes its rewards, so one shown done has its
    # rewards in the snapshot read after it.
    jobs = await jobs_of_session(services.session_factory, session_id)
    snapshot = await load_session_snapshot(services.session_factory, session_id)
    if snapshot is None:
        raise _not_found("session", session_id)
    prompt_lengths = _prompt_lengths(snapshot.completions)
    return SessionView(
        session_id=snapshot.id,
        status=snapshot.status,
        group_id=snapshot.group_id,
        task=snapshot.task,
        metadata=snapshot.metadata,
        created_at=snapshot.created_at.isoformat(),
        ended_at=None if snapshot.ended_at is None else snapshot.ended_at.isoformat(),
        completions=[
            CompletionSummary(
                id=c.id, parent_id=c.parent_id, finish_reason=c.finish_reason,
                prompt_tokens=prompt_lengths[c.id], completion_tokens=len(c.output_ids),
                versions=sorted({int(v) for v in c.output_versions}), temperature=c.temperature,
                orphan_of=c.orphan_of,
            )
            for c in snapshot.completions
        ],
        rewards=[
            RewardSummary(
                id=r.id, value=r.value, source=r.source, completion_id=r.completion_id, details=r.details,
                created_at=r.created_at.isoformat(),
            )
            for r in snapshot.rewards
        ],
        hooks=[
            HookJobView(
                level=job.level, source=job.source, state=job.state, attempts=job.attempts,
                max_attempts=job.max_attempts, error=job.error, result=job.result,
                created_at=as_utc(job.created_at).isoformat(),
                finished_at=None if job.finished_at is None else as_utc(job.finished_at).isoformat(),
            )
            for job in jobs
        ],
        feedback=[
            FeedbackSummary(id=f.id, completion_id=f.completion_id, value=f.value, thumbs=f.thumbs,
                            state=f.state, created_at=f.created_at.isoformat())
            for f in snapshot.feedback
        ],
    )


def _prompt_lengths(completions: Sequence[CompletionRecord]) -> dict[str, int]:
    """Full prompt length of each completion: its suffix plus its parent's prompt and output."""
    by_id = {c.id: c for c in completions}
    lengths: dict[str, int] = {}
    for completion in completions:
        pending: list[CompletionRecord] = []
        node: CompletionRecord | None = completion
        while node is not None and node.id not in lengths:
            pending.append(node)
            node = by_id.get(node.parent_id) if node.parent_id else None
        for item in reversed(pending):
            parent = by_id.get(item.parent_id) if item.parent_id else None
            inherited = 0 if parent is None else lengths[parent.id] + len(parent.output_ids)
            lengths[item.id] = inherited + len(item.prompt_ids)
    return lengths


async def last_completion_id(session_factory: SessionFactory, session_id: str) -> str | None:
    """The session's latest completion in call order (AReaL's `interaction_id: null`)."""
    async with session_factory() as db:
        return await db.scalar(
            select(Completion.id)
            .where(Completion.session_id == session_id)
            .order_by(Completion.created_at.desc(), Completion.id.desc())
            .limit(1)
        )


async def completion_count(session_factory: SessionFactory, session_id: str) -> int:
    async with session_factory() as db:
        count = await db.scalar(
            select(func.count()).select_from(Completion).where(Completion.session_id == session_id)
        )
    return int(count or 0)


async def stored_key(services: ProxyServices, api_key: str) -> FoundKey | None:
    """A stored key by its plaintext, revoked or not; None if it was never issued."""
    return await find_key(services.session_factory, services.key_hasher, api_key, include_revoked=True)


async def rebind_key(services: ProxyServices, key: FoundKey, *, task: Any) -> str:
    """A new session that takes over an existing, unrevoked session key (AReaL's key reuse); returns its
    id. A revoked key stays revoked: the update matches only an unrevoked row. 429 past admission
    control's capacity."""
    session_id = new_session_id()
    with admission_control(services.config.admission, services.metrics, "session") as gate:
        async with write_transaction(services.session_factory) as db:
            if gate is not None:
                await admit(db, 1, gate)
            db.add(Session(id=session_id, task=task, metadata_={}, holds_slot=True,
                           reward_hooks=reward_hooks(services, None, "session")))
            await db.flush()
            rebound = await db.execute(
                update(ApiKey)
                .where(ApiKey.id == key.id, ApiKey.scope == KeyScope.SESSION.value,
                       ApiKey.revoked_at.is_(None))
                .values(session_id=session_id)
            )
            if affected_rows(rebound) != 1:  # revoked meanwhile: the new session is rolled back with it
                raise revoked_key_error()
    logger.info("session %s started on a reused key", session_id)
    return session_id


def revoked_key_error() -> OpenAIError:
    return OpenAIError(
        409, "That api_key was revoked; it cannot start a session again. Choose a new one.", "conflict_error",
        param="api_key", code="key_revoked",
    )


MIN_CLIENT_KEY_CHARS = 32
MIN_CLIENT_KEY_DISTINCT = 8


def check_client_key(api_key: str) -> None:
    """A key the client chose (AReaL's `start_session {api_key}`) must be as hard to guess as those we
    make: at least MIN_CLIENT_KEY_CHARS characters, of at least MIN_CLIENT_KEY_DISTINCT distinct ones.
    Eight, not more: random keys over hex (`openssl rand -hex 16`, uuid4) show about 14 distinct
    characters in 32 and often fewer than 16, while fewer than 8 happens to about one in 30 million;
    repeated or few-symbol strings fall below it. 400 otherwise, before anything is looked up."""
    if len(api_key) >= MIN_CLIENT_KEY_CHARS and len(set(api_key)) >= MIN_CLIENT_KEY_DISTINCT:
        return
    raise OpenAIError(
        400, f"A client-chosen api_key must be at least {MIN_CLIENT_KEY_CHARS} characters long and use at "
        f"least {MIN_CLIENT_KEY_DISTINCT} distinct characters: make it at random (e.g. `openssl rand -hex "
        "32`), or leave it out and use the key this route returns.",
        "invalid_request_error", param="api_key", code="weak_api_key",
    )


def key_view(info: KeyInfo) -> KeyView:
    revoked_at = None if info.revoked_at is None else info.revoked_at.isoformat()
    return KeyView(id=info.id, kind=info.scope, created_at=info.created_at.isoformat(), revoked_at=revoked_at,
                   session_id=info.session_id)


async def revoke(services: ProxyServices, key_id: int) -> KeyView:
    """Revoke a key (idempotent); 404 for an unknown id, 409 for the last unrevoked admin key."""
    try:
        info = await revoke_key(services.session_factory, key_id)
    except LookupError:
        raise _not_found("key", str(key_id)) from None
    except LastAdminKeyError as exc:
        raise OpenAIError(409, f"{exc}.", "conflict_error", code="last_admin_key") from None
    return key_view(info)
