"""User feedback (`POST /rl/v1/feedback`) end to end, on SQLite and Postgres: completions made with the real
`openai` client through the real proxy (a scripted worker), feedback given over HTTP, and what it wrote
read back from the database. Feedback on a session not yet finalized is a reward its trajectories
include; on a finalized one it changes the trajectories that train its completion while none is claimed,
and is only stored (late) once they are; refusals write nothing, and nothing is ever half-written."""

from __future__ import annotations

from typing import Any

import pytest

from rewards.config import FinalizerConfig, HookRunnerConfig, RewardsConfig
from rewards.hooks.spec import HookSpec
from tests.support.databases import key_hasher
from tests.support.feedback import (
    SESSION_HEADER,
    chat,
    claim_all,
    consume_all,
    feedback_inserts_fail,
    feedback_rows,
    new_online_key,
    post_feedback,
    reward_rows,
    rl,
    trajectory_rewards,
    wait_for_status,
)
from tests.support.proxy_harness import Proxy, ProxyFactory, metric
from tests.support.scripted_worker import ScriptedWorker

SOURCE = "feedback"


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, scripted: ScriptedWorker) -> Proxy:
    """A proxy whose finalizer sweeps often and waits long for missing rewards (sessions finalize when
    their rewards make them ready, not by the clock)."""
    return proxies.start(
        [scripted.url],
        health_check_interval_s=0,
        finalizer=FinalizerConfig(sweep_interval_s=0.2, reward_grace_s=3600),
    )


def applied(response: Any) -> dict[str, Any]:
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    assert body["state"] == "applied"
    return body


def finalized_with_one_trajectory(proxy: Proxy, value: float) -> tuple[str, str]:
    """(session id, completion id) of the proxy's session key's one call, given `value` as feedback,
    ended and finalized into one trajectory of that reward."""
    session_id, [completion_id] = chat(proxy, proxy.session_key, "Hello.")
    applied(post_feedback(proxy, proxy.session_key, {"completion_id": completion_id, "value": value}))
    assert rl(proxy, "POST", f"/rl/v1/sessions/{session_id}/end", proxy.session_key).status_code == 200
    wait_for_status(proxy, session_id, "finalized")  # its reward made it ready
    assert trajectory_rewards(proxy, session_id) == [value]
    return session_id, completion_id


def test_feedback_by_id_on_chat_responses_and_legacy_completions(proxy: Proxy) -> None:
    key = new_online_key(proxy)
    chat_session, [first_choice, second_choice] = chat(proxy, key, "Plan a trip.", n=2)
    response = proxy.client(key).responses.with_raw_response.create(
        model="m", input="Count.", max_output_tokens=4
    )
    response_id, response_session = response.parse().id, response.headers[SESSION_HEADER]
    legacy = proxy.client(key).completions.create(model="m", prompt="Once upon a time", max_tokens=4)
    assert response_id.startswith("resp_") and legacy.id.startswith("cmpl-")

    given = [
        ({"completion_id": first_choice, "value": 0.25}, 0.25),
        ({"completion_id": second_choice, "thumbs": "up", "comment": "Great plan."}, 1.0),
        ({"completion_id": response_id, "thumbs": "down"}, -1.0),
        ({"completion_id": legacy.id, "comment": "Too short."}, None),
    ]
    answers = [applied(post_feedback(proxy, key, body)) for body, _ in given]

    assert [a["completion_id"] for a in answers] == [body["completion_id"] for body, _ in given]
    assert answers[0]["session_id"] == answers[1]["session_id"] == chat_session
    assert answers[2]["session_id"] == response_session
    assert answers[3]["reward_id"] is None  # a comment alone writes no reward
    rewards = {r.id: r for r in reward_rows(proxy, SOURCE)}
    assert len(rewards) == 3
    for answer, (body, value) in zip(answers[:3], given[:3], strict=True):
        reward = rewards[answer["reward_id"]]
        assert (reward.completion_id, reward.value, reward.session_id) == (body["completion_id"], value, None)
    rows = feedback_rows(proxy)
    assert [(r.completion_id, r.value, r.thumbs, r.comment, r.state) for r in rows] == [
        (first_choice, 0.25, None, None, "applied"),
        (second_choice, 1.0, "up", "Great plan.", "applied"),
        (response_id, -1.0, "down", None, "applied"),
        (legacy.id, None, None, "Too short.", "applied"),
    ]
    assert {r.key_hash for r in rows} == {key_hasher(proxy.db_url).hash(key)}
    assert metric(proxy.base_url, "flywheel_feedback_total", {"state": "applied"}) == 4

    view = rl(proxy, "GET", f"/rl/v1/sessions/{chat_session}", key).json()
    assert [(f["completion_id"], f["value"], f["thumbs"], f["state"]) for f in view["feedback"]] == [
        (first_choice, 0.25, None, "applied"),
        (second_choice, 1.0, "up", "applied"),
    ]
    assert all(f["created_at"] and f["id"] for f in view["feedback"])


def test_feedback_without_an_id_is_on_the_keys_latest_completion(proxy: Proxy) -> None:
    key = new_online_key(proxy)
    chat(proxy, key, "Plan a trip.")
    poem_session, [poem] = chat(proxy, key, "Write a poem.")
    assert applied(post_feedback(proxy, key, {"value": 1.0}))["completion_id"] == poem
    _trip, [latest] = chat(proxy, key, "Plan another trip.")
    assert applied(post_feedback(proxy, key, {"thumbs": "down"}))["completion_id"] == latest

    session_id, [first] = chat(proxy, proxy.session_key, "One.")
    _same, [second] = chat(proxy, proxy.session_key, "Two.")
    answer = applied(post_feedback(proxy, proxy.session_key, {"value": 0.5}))
    assert (answer["completion_id"], answer["session_id"]) == (second, session_id) and first != second

    admin = post_feedback(proxy, proxy.admin_key, {"value": 1.0})
    assert admin.status_code == 422 and admin.json()["error"]["param"] == "completion_id"
    _fresh, fresh_key = proxy.new_session_key()
    assert post_feedback(proxy, fresh_key, {"value": 1.0}).status_code == 404  # nothing to give it on
    assert post_feedback(proxy, new_online_key(proxy), {"value": 1.0}).status_code == 404
    assert len(feedback_rows(proxy)) == 3 and poem_session != session_id


def test_feedback_after_the_session_ended_joins_its_trajectories(proxy: Proxy) -> None:
    session_id, [completion_id] = chat(proxy, proxy.session_key, "Hello.")
    assert rl(proxy, "POST", f"/rl/v1/sessions/{session_id}/end", proxy.session_key).status_code == 200
    assert wait_for_status(proxy, session_id, "ended")["rewards"] == []

    answer = applied(post_feedback(proxy, proxy.session_key, {"completion_id": completion_id, "value": 0.75}))
    assert answer["reward_id"] is not None
    view = wait_for_status(proxy, session_id, "finalized")  # the feedback's reward made it ready
    assert trajectory_rewards(proxy, session_id) == [0.75]
    assert [(r["source"], r["value"]) for r in view["rewards"]] == [(SOURCE, 0.75)]


def test_feedback_after_finalization_changes_unclaimed_trajectories(proxy: Proxy) -> None:
    session_id, completion_id = finalized_with_one_trajectory(proxy, -1.0)

    answer = applied(post_feedback(proxy, proxy.session_key, {"completion_id": completion_id, "value": 0.5}))
    assert trajectory_rewards(proxy, session_id) == [0.5]  # the latest feedback replaces the first
    applied(post_feedback(proxy, proxy.admin_key, {"completion_id": completion_id, "thumbs": "up"}))
    assert trajectory_rewards(proxy, session_id) == [1.0]
    assert [r.value for r in reward_rows(proxy, SOURCE)] == [-1.0, 0.5, 1.0]
    assert answer["reward_id"] == reward_rows(proxy, SOURCE)[1].id

    comment = post_feedback(proxy, proxy.session_key, {"completion_id": completion_id, "comment": "ok"})
    assert comment.status_code == 201 and comment.json()["state"] == "late"  # nothing left to read it
    assert trajectory_rewards(proxy, session_id) == [1.0]
    view = rl(proxy, "GET", f"/rl/v1/sessions/{session_id}", proxy.session_key).json()
    assert [f["state"] for f in view["feedback"]] == ["applied", "applied", "applied", "late"]


def test_feedback_after_consumption_is_late(proxy: Proxy) -> None:
    session_id, completion_id = finalized_with_one_trajectory(proxy, 1.0)
    consume_all(proxy)
    before = reward_rows(proxy)

    late = post_feedback(proxy, proxy.session_key, {"completion_id": completion_id, "value": -1.0})
    assert late.status_code == 201, late.text
    assert late.json()["state"] == "late" and late.json()["reward_id"] is None
    assert [r.id for r in reward_rows(proxy)] == [r.id for r in before]
    assert trajectory_rewards(proxy, session_id) == [1.0]
    assert [(r.state, r.value, r.reward_id) for r in feedback_rows(proxy)][-1] == ("late", -1.0, None)
    assert metric(proxy.base_url, "flywheel_feedback_total", {"state": "late"}) == 1


def test_feedback_after_a_claim_is_late(proxy: Proxy) -> None:
    session_id, completion_id = finalized_with_one_trajectory(proxy, 1.0)
    assert len(claim_all(proxy).samples) == 1
    rewards = len(reward_rows(proxy))

    late = post_feedback(proxy, proxy.session_key, {"completion_id": completion_id, "thumbs": "down"})
    assert late.status_code == 201 and late.json()["state"] == "late"
    assert len(reward_rows(proxy)) == rewards and trajectory_rewards(proxy, session_id) == [1.0]


def test_feedback_from_another_key_is_refused(proxy: Proxy) -> None:
    key = new_online_key(proxy)
    _session, [completion_id] = chat(proxy, key, "Mine.")
    _other, other_session_key = proxy.new_session_key()
    for stranger in (other_session_key, new_online_key(proxy)):
        refused = post_feedback(proxy, stranger, {"completion_id": completion_id, "value": 1.0})
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "wrong_session"
    unknown = post_feedback(proxy, key, {"completion_id": "chatcmpl-nope", "value": 1.0})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "completion_not_found"
    assert feedback_rows(proxy) == [] and reward_rows(proxy) == []


def test_malformed_feedback_is_refused_and_writes_nothing(proxy: Proxy) -> None:
    _session, [completion_id] = chat(proxy, proxy.session_key, "Hello.")
    bad_bodies: list[tuple[dict[str, Any] | bytes, int, str | None]] = [
        (b"{not json", 400, None),
        (b'{"value": NaN}', 422, "value"),
        (b'{"value": 1.0, "comment": "a\\u0000b"}', 400, None),
        ({}, 422, None),
        ({"completion_id": completion_id}, 422, None),
        ({"value": 1.0, "thumbs": "up"}, 422, None),
        ({"value": "1"}, 422, "value"),
        ({"value": True}, 422, "value"),
        ({"value": 1e7}, 422, "value"),
        ({"thumbs": "sideways"}, 422, "thumbs"),
        ({"comment": ""}, 422, "comment"),
        ({"comment": "x" * 20000}, 422, "comment"),
        ({"value": 1.0, "reward": 2.0}, 422, "reward"),
        ({"value": 1.0, "completion_id": ""}, 422, "completion_id"),
        ([1.0], 422, None),
    ]
    for body, status, param in bad_bodies:
        if isinstance(body, bytes):
            answer = post_feedback(proxy, proxy.session_key, content=body)
        else:
            answer = post_feedback(proxy, proxy.session_key, body)
        assert answer.status_code == status, (body, answer.text)
        if param is not None:
            assert answer.json()["error"]["param"] == param, (body, answer.text)
    assert feedback_rows(proxy) == [] and reward_rows(proxy) == []


def test_a_failed_feedback_leaves_nothing_half_written(proxy: Proxy) -> None:
    """The reward, the trajectories' change and the feedback row are one transaction: when its last
    write (the feedback row) fails, the reward and the change before it are rolled back."""
    session_id, completion_id = finalized_with_one_trajectory(proxy, 1.0)
    _online_session, [online] = chat(proxy, new_online_key(proxy), "Hi.")  # an active session
    rewards, feedback = reward_rows(proxy), feedback_rows(proxy)

    with feedback_inserts_fail(proxy.db_url):
        failed = post_feedback(proxy, proxy.admin_key, {"completion_id": completion_id, "value": -1.0})
        failed_active = post_feedback(proxy, proxy.admin_key, {"completion_id": online, "value": 0.5})
    assert failed.status_code >= 500 and failed_active.status_code >= 500
    assert [r.id for r in reward_rows(proxy)] == [r.id for r in rewards]
    assert [f.id for f in feedback_rows(proxy)] == [f.id for f in feedback]
    assert trajectory_rewards(proxy, session_id) == [1.0]

    applied(post_feedback(proxy, proxy.admin_key, {"completion_id": completion_id, "value": -1.0}))
    assert trajectory_rewards(proxy, session_id) == [-1.0]


def test_feedback_is_rate_limited_per_key_apart_from_inference(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    proxy = proxies.start(
        [scripted.url],
        health_check_interval_s=0,
        rate_limits={"feedback": {"requests_per_s": 0.01, "burst": 2}},
    )
    key = new_online_key(proxy)
    chat(proxy, key, "Hello.")
    answers = [post_feedback(proxy, key, {"thumbs": "up"}) for _ in range(3)]
    assert [a.status_code for a in answers] == [201, 201, 429]
    refused = answers[2]
    assert refused.json()["error"]["type"] == "rate_limit_error" and int(refused.headers["retry-after"]) >= 1
    chat(proxy, key, "Still served.")  # inference spends a bucket of its own
    other = new_online_key(proxy)
    chat(proxy, other, "Hi.")
    assert post_feedback(proxy, other, {"value": 1.0}).status_code == 201  # the limit is the key's own
    assert len(feedback_rows(proxy)) == 3


def test_the_feedback_hook_labels_a_session_by_its_feedback(
    proxies: ProxyFactory, scripted: ScriptedWorker
) -> None:
    """An online key's sessions labelled by the `feedback` hook: once the session ends, the hook reads the
    feedback stored with it (each completion's latest) and writes their mean as the session's reward."""
    rewards = RewardsConfig(
        online_hooks=[HookSpec(hook="feedback")],
        runner=HookRunnerConfig(poll_interval_s=0.05, backoff_s=0.05),
    )
    proxy = proxies.start(
        [scripted.url],
        rewards,
        health_check_interval_s=0,
        finalizer=FinalizerConfig(sweep_interval_s=0.2, reward_grace_s=3600),
    )
    key = new_online_key(proxy)
    session_id, [completion_id] = chat(proxy, key, "Hello.")
    for body in ({"thumbs": "up"}, {"value": 0.5, "comment": "Better now."}, {"comment": "Thanks."}):
        applied(post_feedback(proxy, key, {"completion_id": completion_id, **body}))
    assert rl(proxy, "POST", f"/rl/v1/sessions/{session_id}/end", key).status_code == 200

    view = wait_for_status(proxy, session_id, "finalized")
    assert [(h["source"], h["state"]) for h in view["hooks"]] == [("hook:feedback", "done")]
    labels = {(r["source"], r["completion_id"]): r["value"] for r in view["rewards"]}
    assert labels == {(SOURCE, completion_id): 0.5, ("hook:feedback", None): 0.5}
    assert trajectory_rewards(proxy, session_id) == [1.0]  # the latest feedback and the hook's label
