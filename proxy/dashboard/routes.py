"""The dashboard's routes: the page (`GET /dashboard`) and its assets, open to anyone as they hold no data,
and the JSON endpoints under `/dashboard/api/`, each for admin keys only (401 without a valid key, 403
for a session or online key). docs/dashboard.md documents every endpoint, parameter and field."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query

from proxy.auth import Principal, require_admin
from proxy.dashboard import charts, page
from proxy.dashboard.documents import DashboardJSON, reward_range
from proxy.dashboard.params import aware, decode_cursor, encode_cursor, text_param
from proxy.dashboard.sessions import MAX_TOKENS_PER_COMPLETION, TokenBudget, session_json, session_row_json
from proxy.dashboard.sessions import token_columns as token_page
from proxy.errors import OpenAIError
from proxy.services import ProxyServices, get_services
from rewards.snapshot import load_session_snapshot
from storage.dashboard.rewards import MAX_REWARDED_SESSIONS, RewardQuery, rewarded_sessions
from storage.dashboard.sessions import MAX_PAGE, SessionTableFilter, load_completion, session_page
from storage.dashboard.throughput import MAX_BUCKETS, MAX_SPAN_S, throughput
from storage.dashboard.training import MAX_STEPS, MAX_VERSIONS, staleness, version_rows
from storage.ops_queries import backlog, session_trajectories, train_progress
from storage.policy_versions import best_version, newest_version, served_version
from storage.reward_jobs import jobs_of_session

Services = Annotated[ProxyServices, Depends(get_services)]
Admin = Annotated[Principal, Depends(require_admin)]

API = "/dashboard/api"
THROUGHPUT_WINDOWS_S = (60, 300, 900, 3600)
MAX_ID_CHARS = 64  # session and completion ids are at most this long (storage/models.py)


def build_dashboard_router() -> APIRouter:
    """`/dashboard`, its assets and its JSON API."""
    router = APIRouter()
    router.add_api_route("/dashboard", page.page, methods=["GET"], include_in_schema=False)
    router.add_api_route("/dashboard/static/{name}", page.asset, methods=["GET"], include_in_schema=False)
    for path, endpoint in (
        ("summary", summary), ("rewards", rewards), ("versions", versions), ("staleness", stale),
        ("throughput", rates), ("sessions", sessions), ("sessions/{session_id}", session),
        ("completions/{completion_id}/tokens", completion_tokens),
    ):
        # Documented in docs/dashboard.md rather than the OpenAPI document, whose every operation the
        # schema fuzz test exercises: these GETs' bad parameters are tested in test_dashboard_api.py.
        router.add_api_route(f"{API}/{path}", endpoint, methods=["GET"], response_class=DashboardJSON,
                             include_in_schema=False)
    return router


async def _policy(services: ProxyServices) -> charts.PolicyState:
    factory = services.session_factory
    return charts.PolicyState(served=await served_version(factory), best=await best_version(factory),
                              newest=await newest_version(factory))


async def summary(_admin: Admin, services: Services) -> DashboardJSON:
    """Counts of what waits where, the trainer's steps, and the served, best and newest versions."""
    factory = services.session_factory
    found = charts.summary_json(datetime.now(UTC), await backlog(factory), await train_progress(factory),
                                await _policy(services))
    return DashboardJSON(found)


async def rewards(
    _admin: Admin, services: Services,
    by: Literal["run", "task"] = "run",
    run: str | None = None,
    task: str | None = None,
    since: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_REWARDED_SESSIONS)] = 1000,
    max_series: Annotated[int, Query(ge=1, le=100)] = 12,
) -> DashboardJSON:
    """Reward curves: the `limit` sessions rewarded last (of `run`, created `since`), their rewards
    combined as the finalizer combines them, one series per run or per task (`task`: one task's key)."""
    query = RewardQuery(run=text_param(run, "run"), since=aware(since, "since"), limit=limit)
    found = await rewarded_sessions(services.session_factory, query)
    if task is not None:
        found = [s for s in found if s.task is not None and s.task.key == task]
    rule = services.config.finalizer.rest_and_hooks
    return DashboardJSON(charts.reward_series_json(found, rule, by, max_series))


async def versions(
    _admin: Admin, services: Services,
    limit: Annotated[int, Query(ge=1, le=MAX_VERSIONS)] = 200,
    metrics: str | None = None,
) -> DashboardJSON:
    """Policy versions newest first: status, evaluation, the step that trained each and its metrics
    (`metrics`: only these comma-separated names)."""
    rows, truncated = await version_rows(services.session_factory, limit)
    keys = [k.strip() for k in (metrics or "").split(",") if k.strip()]
    return DashboardJSON(charts.versions_json(rows, truncated, await _policy(services), keys))


async def stale(
    _admin: Admin, services: Services,
    steps: Annotated[int, Query(ge=1, le=MAX_STEPS)] = 100,
    max_lag: Annotated[int, Query(ge=1, le=1000)] = 32,
) -> DashboardJSON:
    """Staleness histograms: samples trained by the last `steps` steps and samples waiting, by lag."""
    found = await staleness(services.session_factory, steps)
    return DashboardJSON(charts.staleness_json(found, max_lag))


async def rates(
    _admin: Admin, services: Services,
    span_s: Annotated[int, Query(ge=60, le=MAX_SPAN_S)] = 3600,
    buckets: Annotated[int, Query(ge=1, le=MAX_BUCKETS)] = 60,
) -> DashboardJSON:
    """Completions, generated tokens, settled hook jobs and trajectories per second over the last
    minute, 5, 15 and 60 minutes, and per bucket over the last `span_s` seconds."""
    found = await throughput(services.session_factory, datetime.now(UTC), THROUGHPUT_WINDOWS_S, span_s,
                             buckets)
    return DashboardJSON(charts.throughput_json(found))


async def sessions(
    _admin: Admin, services: Services,
    run: str | None = None,
    state: Literal["active", "ended", "finalized"] | None = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False)] = None,
    since: datetime | None = None,
    until: datetime | None = None,
    key: Annotated[int | None, Query(ge=1, le=2**63 - 1)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50,
    cursor: str | None = None,
) -> DashboardJSON:
    """Sessions newest first, a page at a time (`next_cursor`), filtered by run, state, combined reward
    (inclusive bounds; a session without a reward never matches one), creation time and API key id."""
    filt = SessionTableFilter(status=state, run=text_param(run, "run"), since=aware(since, "since"),
                              until=aware(until, "until"), key_id=key)
    rule = services.config.finalizer.rest_and_hooks
    keep = reward_range(rule, min_reward, max_reward)
    found = await session_page(services.session_factory, filt, decode_cursor(cursor), limit, keep)
    return DashboardJSON({
        "sessions": [session_row_json(row, rule) for row in found.rows],
        "next_cursor": encode_cursor(found.next), "scanned": found.scanned,
    })


async def session(
    session_id: str, _admin: Admin, services: Services,
    tokens: Annotated[int, Query(ge=0, le=MAX_TOKENS_PER_COMPLETION)] = 256,
) -> DashboardJSON:
    """One session: its conversation tree with each completion's first `tokens` generated tokens (text,
    logprob, version), rewards, hook jobs and trajectories."""
    factory = services.session_factory
    _check_id(session_id, "session")
    jobs = await jobs_of_session(factory, session_id)  # first: a job shown done has its rewards read after
    snapshot = await load_session_snapshot(factory, session_id)
    if snapshot is None:
        raise _not_found("session", session_id)
    samples = await session_trajectories(factory, session_id)
    document = session_json(snapshot, jobs, samples, services.config.finalizer.rest_and_hooks,
                            services.tokenizer, TokenBudget(per_completion=tokens))
    return DashboardJSON(document)


async def completion_tokens(
    completion_id: str, _admin: Admin, services: Services,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_TOKENS_PER_COMPLETION)] = 1024,
) -> DashboardJSON:
    """A page of one completion's generated tokens: ids, text, logprobs and versions."""
    _check_id(completion_id, "completion")
    found = await load_completion(services.session_factory, completion_id)
    if found is None:
        raise _not_found("completion", completion_id)
    return DashboardJSON({"completion_id": found.id, "session_id": found.session_id,
                          **token_page(services.tokenizer, found, offset, limit)})


def _check_id(value: str, kind: str) -> None:
    """Ids no row can have (too long, or with a NUL no database stores) are simply not found."""
    if len(value) > MAX_ID_CHARS or "\x00" in value:
        raise _not_found(kind, value[:MAX_ID_CHARS])


def _not_found(kind: str, value: str) -> OpenAIError:
    return OpenAIError(404, f"No {kind} {value!r}.", "invalid_request_error", code=f"{kind}_not_found")
