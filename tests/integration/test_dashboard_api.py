"""The dashboard's JSON API (docs/dashboard.md) on a recorded run (tests/support/dashboard.py: the operated
run with a reward on six sessions), read through a real proxy: admin keys only, and every number matches
what was written, on SQLite and Postgres (the time series' SQL differs between them)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from storage.migrate import upgrade
from storage.queries import create_session, record_completions
from storage.records import SessionRecord
from tests.support.dashboard import (
    REWARDS,
    DashboardApi,
    all_sessions,
    dashboard_proxy,
    record_dashboard_run_at,
)
from tests.support.databases import key_hash, run_outside_loop
from tests.support.operated_run import OperatedRun, completion
from tests.support.proxy_harness import Proxy, ProxyFactory, run_db

ENDPOINTS = ["summary", "rewards", "versions", "staleness", "throughput", "sessions", "sessions/b-1",
             "completions/b-1-c1/tokens"]
RUN_SESSIONS = ["a-4", "a-3", "b-3", "b-2", "b-1", "a-2", "a-1"]  # newest first


@pytest.fixture(scope="module")
def recorded(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[Proxy, OperatedRun]]:
    """One SQLite database holding the run and a proxy on it, shared by the module's read-only tests."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('dashboard') / 'flywheel.db'}"
    run_outside_loop(upgrade, url)
    run = record_dashboard_run_at(url)
    factory = ProxyFactory(url, tiny_model_dir)
    with factory.stack:
        yield dashboard_proxy(factory), run


@pytest.fixture
def api(recorded: tuple[Proxy, OperatedRun]) -> DashboardApi:
    return DashboardApi(recorded[0].base_url, recorded[0].admin_key)


def test_every_endpoint_reports_the_recorded_run(db_url: str, proxies: ProxyFactory) -> None:
    run = record_dashboard_run_at(db_url)  # sqlite and postgres
    proxy = dashboard_proxy(proxies)
    api = DashboardApi(proxy.base_url, proxy.admin_key)

    summary = api.json("summary")
    assert summary["sessions"] == {"active": 2, "ended": 1, "finalized": 5}  # a-3 and the harness's own
    assert summary["trajectories"] == {"total": 5, "unconsumed": 2, "claimed": 1, "consumed": 3, "dropped": 0}
    assert summary["reward_jobs"] == {"queued": 1, "running": 0, "done": 0, "failed": 0}
    policy = summary["policy"]
    assert [policy[k]["version"] for k in ("served", "best", "newest")] == [1, 0, 2]
    assert (policy["newest"]["status"], policy["versions"]) == (
        "rejected", {"candidate": 0, "promoted": 2, "rejected": 1})

    curves = api.json("rewards")
    assert {s["key"]: dict(zip(s["sessions"], s["rewards"], strict=True)) for s in curves["series"]} == {
        "a": {sid: REWARDS[sid] for sid in ("a-1", "a-2", "a-3")},
        "b": {sid: REWARDS[sid] for sid in ("b-1", "b-2", "b-3")},
    }
    for series in curves["series"]:
        assert series["times"] == sorted(series["times"])
        assert math.isclose(series["mean"], sum(series["rewards"]) / 3)
    assert [s["key"] for s in api.json("rewards", run="b")["series"]] == ["b"]
    per_task = api.json("rewards", by="task", max_series=4)
    assert (len(per_task["series"]), per_task["other_series"]) == (4, 2)
    assert {s["label"] for s in per_task["series"]} <= {f"task of {sid}" for sid in REWARDS}

    versions = api.json("versions")
    assert (versions["served"], versions["best"], versions["newest"]) == (1, 0, 2)
    assert [(v["version"], v["status"], v["eval_score"], v["step"], v["metrics"])
            for v in versions["versions"]] == [
        (2, "rejected", 0.1, 2, {"loss": 0.25}), (1, "promoted", 0.125, 1, {"loss": 0.5}),
        (0, "promoted", 0.25, None, {}),
    ]

    # Trained: a-1 and a-2 (v0 tokens, step from v0), b-1 (oldest v1, step from v1). Waiting: b-2 and b-3,
    # oldest v2, against served v1 (newer than the current version counts as 0 behind).
    staleness = api.json("staleness")
    assert staleness["current_version"] == 1
    assert staleness["trained"] == [{"lag": 0, "count": 3}]
    assert staleness["waiting"] == [{"lag": 0, "count": 2}]

    rates = api.json("throughput", span_s=600, buckets=10)
    minute = rates["windows"][0]
    assert (minute["seconds"], minute["completions"], minute["output_tokens"], minute["trajectories"]) == (
        60, 6, 13, 5)
    assert math.isclose(minute["completions_per_s"], 6 / 60)
    assert (sum(rates["series"]["completions"]), sum(rates["series"]["output_tokens"])) == (6, 13)
    assert len(rates["series"]["trajectories"]) == 10

    assert all_sessions(api, run="a") == ["a-4", "a-3", "a-2", "a-1"]
    assert all_sessions(api, min_reward=0.5, max_reward=1.0) == ["a-3", "b-1", "a-1"]

    shown = api.json("sessions/b-1")
    assert shown["reward"] == {"session": 0.5, "completions": {"b-1-c2": 0.25}, "total": 0.75}
    assert_tokens_round_trip(shown, run)

    # Logprobs the engine reported as NaN or -inf are stored bit-exactly; the answer stays JSON (null).
    weird = replace(completion("nan-c", "nan-s", None, [1, 2], [0, 0, 0]),
                    output_logprobs=np.array([np.nan, -np.inf, -0.5], dtype=np.float32))

    async def write(factory: Any) -> None:
        await create_session(factory, SessionRecord(id="nan-s", key_hash=key_hash("nan-s")))
        await record_completions(factory, [weird])

    run_db(db_url, write)
    answer = api.get("sessions/nan-s")
    assert answer.status_code == 200 and "NaN" not in answer.text and "Infinity" not in answer.text
    assert answer.json()["completions"][0]["tokens"]["logprobs"] == [None, None, -0.5]


def assert_tokens_round_trip(shown: dict[str, Any], run: OperatedRun) -> None:
    """b-1's tree and its completions' tokens: exactly the ids, float32 logprobs and versions written
    (tests/support/operated_run.py `completion`)."""
    written = {c.id: c for c in (
        completion("b-1-c1", "b-1", None, [1, 2, 3, 4], [1, 1]),
        completion("b-1-c2", "b-1", "b-1-c1", [5, 6], [2, 2, 2]),
        completion("b-1-c3", "b-1", "b-1-c1", [7], [2], finish_reason="length"),
    )}
    assert [(c["id"], c["parent_id"], c["depth"], c["branched"], c["prompt_tokens"])
            for c in shown["completions"]] == [
        ("b-1-c1", None, 0, False, 4), ("b-1-c2", "b-1-c1", 1, False, 8), ("b-1-c3", "b-1-c1", 1, False, 7)]
    for c in shown["completions"]:
        tokens, expected = c["tokens"], written[c["id"]]
        assert tokens["ids"] == list(expected.output_ids)
        assert tokens["versions"] == list(expected.output_versions)
        assert np.array_equal(np.array(tokens["logprobs"], dtype=np.float32),
                              np.asarray(expected.output_logprobs, dtype=np.float32))
        assert len(tokens["texts"]) == len(tokens["ids"]) and not tokens["truncated"]
    assert run.trajectories["b-1"].reward == shown["trajectories"][0]["reward"]


def test_no_admin_key_no_data(recorded: tuple[Proxy, OperatedRun]) -> None:
    proxy, _ = recorded
    second_admin = proxy.new_admin_key()  # any admin key, not only the first
    for path in ENDPOINTS:
        assert DashboardApi(proxy.base_url, None).get(path).status_code == 401, path
        assert DashboardApi(proxy.base_url, "fw-admin-wrong").get(path).status_code == 401, path
        refused = DashboardApi(proxy.base_url, proxy.session_key).get(path)
        assert (refused.status_code, refused.json()["error"]["code"]) == (403, "admin_required"), path
        assert DashboardApi(proxy.base_url, second_admin).get(path).status_code == 200, path


def test_the_page_and_its_assets_need_no_key(recorded: tuple[Proxy, OperatedRun]) -> None:
    base = recorded[0].base_url
    page = httpx.get(f"{base}/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script type="module" src="/dashboard/static/dashboard.js">' in page.text
    assert "<script>" not in page.text and " style=" not in page.text  # nothing inline: the CSP allows none
    for name, kind in (("dashboard.js", "text/javascript"), ("charts.js", "text/javascript"),
                       ("session_view.js", "text/javascript"),
                       ("dashboard.css", "text/css")):
        asset = httpx.get(f"{base}/dashboard/static/{name}", timeout=30)
        assert (asset.status_code, asset.headers["content-type"].split(";")[0]) == (200, kind)
        assert "http://" not in asset.text.replace("http://www.w3.org/2000/svg", "")  # nothing from elsewhere
    assert httpx.get(f"{base}/dashboard/static/index.html.bak", timeout=30).status_code == 404


def test_sessions_page_by_cursor_and_filter(api: DashboardApi, recorded: tuple[Proxy, OperatedRun]) -> None:
    proxy, run = recorded
    everything = all_sessions(api)
    assert everything[1:] == RUN_SESSIONS and everything[0] == proxy.session_id
    assert all_sessions(api, limit=2) == everything  # pages of two, in order, nothing twice
    first = api.json("sessions", limit=7)
    assert [s["session_id"] for s in first["sessions"]] == everything[:7] and first["next_cursor"]
    assert api.json("sessions", limit=8)["next_cursor"] is None

    assert all_sessions(api, state="finalized", limit=2) == ["b-3", "b-2", "b-1", "a-2", "a-1"]
    assert all_sessions(api, min_reward=0.0, limit=1) == ["a-3", "b-3", "b-1", "a-2", "a-1"]
    assert all_sessions(api, max_reward=-0.5) == ["b-2"]
    assert all_sessions(api, run="b", min_reward=1.0) == ["b-3"]
    assert run.after_b1 is not None
    assert all_sessions(api, run="b", since=run.after_b1.isoformat()) == ["b-3", "b-2"]
    assert all_sessions(api, run="b", until=run.after_b1.isoformat()) == ["b-1"]
    assert all_sessions(api, run="nobody") == []

    listed = httpx.get(f"{proxy.base_url}/rl/v1/keys", params={"kind": "session"}, timeout=30,
                       headers={"Authorization": f"Bearer {proxy.admin_key}"}).json()["data"]
    keys = {k["session_id"]: k["id"] for k in listed}
    assert all_sessions(api, key=keys["b-2"]) == ["b-2"]

    row = api.json("sessions", run="b", limit=1)["sessions"][0]
    assert {k: row[k] for k in ("session_id", "status", "completions", "output_tokens", "trajectories",
                                "reward")} == {
        "session_id": "b-3", "status": "finalized", "completions": 0, "output_tokens": 0, "trajectories": 1,
        "reward": 2.0}
    assert row["task"]["text"] == "task of b-3" and row["task"]["key"].startswith("task:")


@pytest.mark.parametrize("params", [
    {"cursor": "not-a-cursor"}, {"min_reward": "nan"}, {"max_reward": "inf"}, {"limit": 0}, {"limit": 201},
    {"state": "gone"}, {"since": "yesterday"}, {"key": 0}, {"run": "a\x00b"},
])
def test_sessions_refuse_bad_parameters(api: DashboardApi, params: dict[str, Any]) -> None:
    answer = api.get("sessions", **params)
    assert answer.status_code == 400, (params, answer.text)
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].removeprefix("query.") == next(iter(params))  # validation names `query.limit`


def test_a_session_drill_down_caps_its_tokens(api: DashboardApi) -> None:
    shown = api.json("sessions/b-1", tokens=1)
    assert [(c["tokens"]["ids"], c["tokens"]["total"], c["tokens"]["truncated"])
            for c in shown["completions"]] == [
        ([100], 2, True), ([100], 3, True), ([100], 1, False)]
    page = api.json("completions/b-1-c2/tokens", offset=1, limit=5)
    assert (page["session_id"], page["offset"], page["total"], page["ids"], page["versions"]) == (
        "b-1", 1, 3, [101, 102], [2, 2])
    assert api.json("completions/b-1-c2/tokens", offset=9)["ids"] == []
    for path in ("sessions/nobody", "completions/nobody/tokens", "sessions/" + "x" * 300):
        assert api.get(path).status_code == 404, path
    hooks = api.json("sessions/a-4")["hooks"]
    assert [(h["level"], h["source"], h["state"], h["attempts"]) for h in hooks] == [
        ("session", "hook:math", "queued", 0)]
