"""Privacy through the real proxy, a scripted worker and the `openai` client, on SQLite and Postgres
(docs/privacy.md): redacted chat (plain and streamed) and Responses calls leave no redacted text in any
stored JSON while the conversation chains token-exactly, hooks grade the redacted text and the session
still trains on the real tokens; `previous_response_id` refuses a redacted response; a reloaded tree
never chains onto redacted turns; retention purges the raw JSON of exactly the sessions trained on, in
storage, from the CLI, and in the proxy's background."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from sqlalchemy import select

from storage.engine import SessionFactory
from storage.models import Completion
from storage.queries import create_session, end_session, insert_trajectories, record_completions
from storage.records import CompletionRecord, SessionRecord, TrajectoryRecord
from storage.retention import PURGED, purge_raw_json
from tests.support.chat_stream import assemble_stream
from tests.support.cli import flywheel
from tests.support.databases import key_hash, storage_overrides
from tests.support.finalizing import reward_end_and_finalize, session_trajectories
from tests.support.privacy import age, consume, stored_json, trajectory_ids
from tests.support.proxy_harness import (
    Proxy,
    ProxyFactory,
    install_script,
    metric,
    run_db,
    session_completions,
)
from tests.support.responses_api import full_prompt, rendered, worker_inputs
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

ALICE = "alice.smith@example.com"
CARD = "4111 1111 1111 1111"
BOB = "bob.jones@example.org"
PHONE = "+1 415 555 0100"
IP = "10.20.30.40"
KEY = "sk-live-ABCDEFGHIJKLMNOPQRST"
SECRETS = (ALICE, CARD, BOB, PHONE, IP, KEY)
PATTERNS = {"redact": "patterns"}
SYSTEM = {"role": "system", "content": "You keep contacts."}
OPENING = {"role": "user", "content": f"I am {ALICE}, card {CARD}. Say hello."}


def reply(prompt: str) -> str:
    """What the scripted model says: contact details, except when only greeted."""
    last = prompt[prompt.rindex("<|im_start|>user") :]
    if "Summarize." in last:
        return f"Mail {BOB}."
    if "my IP" in last:
        return f"Noted {IP}; call {PHONE}."
    if "Just say hello." in last or "Thanks." in last:
        return "Hello there."
    return f"Hello! Reach {BOB}."


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


def rl_post(proxy: Proxy, path: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    response = httpx.post(
        f"{proxy.base_url}/rl/v1{path}", json=body, headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status_code in (200, 201), response.text
    return dict(response.json())


def chained(rows: list[Completion]) -> list[list[int]]:
    """Each completion's whole prompt: parent prompt + parent output + its own suffix."""
    prompts: list[list[int]] = [rows[0].prompt_ids.tolist()]
    for parent, row in itertools.pairwise(rows):
        prompts.append([*prompts[-1], *parent.output_ids.tolist(), *row.prompt_ids.tolist()])
    return prompts


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(0.1)


def assert_nothing_redacted_is_stored(db_url: str) -> None:
    stored = run_db(db_url, stored_json)
    assert [secret for secret in SECRETS if secret in stored] == []


def test_a_redacted_chat_chains_stores_no_redacted_text_and_still_trains(
    proxies: ProxyFactory, worker: ScriptedWorker, script: TextScript
) -> None:
    proxy = proxies.start([worker.url], privacy=PATTERNS, health_check_interval_s=0)
    # The hook grades the stored (redacted) final answer: it matches only what redaction left of it.
    created = rl_post(
        proxy,
        "/sessions",
        {"metadata": {"answer": "Mail [EMAIL]."}, "reward": {"hook": "exact"}},
        proxy.admin_key,
    )
    session_id, client = created["session_id"], proxy.client(created["api_key"])

    messages: list[dict[str, Any]] = [SYSTEM, OPENING]
    first = client.chat.completions.create(model="m", messages=messages, logprobs=True, top_logprobs=2)
    assert first.choices[0].message.content == f"Hello! Reach {BOB}."  # the client gets the answer whole
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": f"And my IP is {IP}, key {KEY}."},
    ]
    streamed = assemble_stream(
        client.chat.completions.create(model="m", messages=messages, stream=True, logprobs=True)
    )
    assert streamed["content"] == f"Noted {IP}; call {PHONE}."
    messages += [
        {"role": "assistant", "content": streamed["content"]},
        {"role": "user", "content": "Summarize."},
    ]
    client.chat.completions.create(model="m", messages=messages)
    rl_post(proxy, f"/sessions/{session_id}/end", {}, created["api_key"])
    wait_for(
        lambda: any(s.id == session_id and s.status == "finalized" for s in proxy.sessions()), "finalization"
    )

    rows = session_completions(proxy, session_id)
    assert [row.parent_id for row in rows] == [None, rows[0].id, rows[1].id] and not any(
        r.branched for r in rows
    )
    assert worker_inputs(worker) == chained(rows)  # each turn sent only its suffix after the parent's tokens
    assert rows[1].request_json["messages"] == [
        {"role": "user", "content": "And my IP is [IP], key [SECRET]."}
    ]
    assert rows[1].response_json["choices"][0]["message"]["content"] == "Noted [IP]; call [PHONE]."
    assert rows[0].request_json["messages"][1]["content"] == "I am [EMAIL], card [CARD]. Say hello."
    logprob_tokens = [entry["token"] for entry in rows[0].response_json["choices"][0]["logprobs"]["content"]]
    assert "[EMAIL]" in "".join(logprob_tokens) and "bob" not in "".join(logprob_tokens)
    assert all(row.request_json["flywheel_redacted"] == "patterns" for row in rows[:2])
    assert_nothing_redacted_is_stored(proxy.db_url)
    # Token ids are never redacted: they hold what the model saw and said.
    assert ALICE in script.tokenizer.decode(rows[0].prompt_ids) and BOB in script.tokenizer.decode(
        rows[0].output_ids
    )

    [trajectory] = run_db(proxy.db_url, lambda f: session_trajectories(f, session_id))
    assert trajectory.token_ids.tolist() == [*chained(rows)[2], *rows[2].output_ids.tolist()]
    assert trajectory.reward == 1.0


def test_responses_are_stored_redacted_and_previous_response_id_refuses_them(
    proxies: ProxyFactory, worker: ScriptedWorker
) -> None:
    proxy = proxies.start([worker.url], privacy=PATTERNS, health_check_interval_s=0)
    client = proxy.client()
    first = client.responses.create(model="m", input=f"I am {ALICE}. Say hello.")
    assert first.output_text == f"Hello! Reach {BOB}."
    assert (
        client.responses.retrieve(first.id).output_text == "Hello! Reach [EMAIL]."
    )  # GET reads the stored JSON
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", input="Summarize.", previous_response_id=first.id)
    assert refused.value.code == "response_redacted" and "previous_response_id" in refused.value.message

    # Sent whole by the client instead, the conversation chains onto the real tokens (streamed here).
    history = [
        {"role": "user", "content": f"I am {ALICE}. Say hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Summarize."},
    ]
    events = list(client.responses.create(model="m", input=history, stream=True))
    second_id = events[-1].response.id
    assert proxy.completion(second_id).parent_id == first.id
    assert worker_inputs(worker)[-1] == full_prompt(proxy, second_id)

    # A response redaction left untouched can still be continued.
    clean = client.responses.create(model="m", input="Just say hello.")
    assert "flywheel_redacted" not in proxy.completion(clean.id).request_json
    follow = client.responses.create(model="m", input="Thanks.", previous_response_id=clean.id)
    assert follow.output_text == "Hello there."
    assert_nothing_redacted_is_stored(proxy.db_url)


def test_redact_all_keeps_only_placeholders_and_still_chains(
    proxies: ProxyFactory, worker: ScriptedWorker
) -> None:
    proxy = proxies.start(
        [worker.url], privacy={"redact": "all", "placeholder": "<gone>"}, health_check_interval_s=0
    )
    client = proxy.client()
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Just say hello."}]
    answer = client.chat.completions.create(model="m", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks."}]
    assemble_stream(client.chat.completions.create(model="m", messages=messages, stream=True))
    response = client.responses.create(model="m", input="Just say hello.", instructions="Be brief.")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="m", input="Thanks.", previous_response_id=response.id)
    assert refused.value.code == "response_redacted"

    rows = session_completions(proxy)
    assert rows[1].parent_id == rows[0].id
    assert rows[1].request_json["messages"] == [{"role": "user", "content": "<gone>"}]
    assert rows[0].response_json["choices"][0]["message"]["content"] == "<gone>"
    assert rows[2].request_json["instructions"] == "<gone>" and rows[2].request_json["input"] == "<gone>"
    stored = run_db(proxy.db_url, stored_json)
    assert all(text not in stored for text in ("hello", "Hello", "Thanks", "keep contacts", "brief"))


def test_a_reloaded_tree_never_chains_onto_redacted_turns(
    proxies: ProxyFactory, worker: ScriptedWorker, script: TextScript, db_url: str, tiny_model_dir: Path
) -> None:
    proxy = proxies.start([worker.url], privacy=PATTERNS, health_check_interval_s=0)
    redacted: list[dict[str, Any]] = [SYSTEM, OPENING]
    clean: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Just say hello."}]
    clean_id, clean_key = proxy.new_session_key()
    for messages, key in ((redacted, proxy.session_key), (clean, clean_key)):
        answer = (
            proxy.client(key).chat.completions.create(model="m", messages=messages).choices[0].message.content
        )
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Thanks."}]
    # What a client reading the stored conversation back would send: the redacted text.
    [stored] = session_completions(proxy)
    as_stored = [
        *stored.request_json["messages"],
        stored.response_json["choices"][0]["message"],
        {"role": "user", "content": "Thanks."},
    ]
    assert as_stored[1]["content"] == "I am [EMAIL], card [CARD]. Say hello."

    factory = ProxyFactory(db_url, tiny_model_dir)  # a fresh process: it knows only the stored rows
    with factory.stack:
        restarted = factory.start([worker.url], privacy=PATTERNS, health_check_interval_s=0)
        for messages, key in (
            (as_stored, proxy.session_key),
            (redacted, proxy.session_key),
            (clean, clean_key),
        ):
            restarted.client(key).chat.completions.create(model="m", messages=messages)
        chained_turns = metric(
            restarted.base_url, "flywheel_proxy_conversation_turns_total", {"kind": "chained"}
        )

    _first, onto_stored, onto_real = session_completions(proxy)
    # Matching the stored placeholders would have put the real tokens under them: rendered afresh instead.
    assert onto_stored.parent_id is None and not onto_stored.branched
    assert worker_inputs(worker)[2] == rendered(script, as_stored) == onto_stored.prompt_ids.tolist()
    assert onto_real.parent_id is None  # the real history is not in the database to chain onto
    assert worker_inputs(worker)[3] == rendered(script, redacted) == onto_real.prompt_ids.tolist()
    clean_rows = session_completions(proxy, clean_id)
    assert clean_rows[1].parent_id == clean_rows[0].id  # a turn redaction left untouched still chains
    assert worker_inputs(worker)[4] == chained(clean_rows)[1]
    assert chained_turns == 1


def completion(cid: str, session_id: str, parent: str | None = None) -> CompletionRecord:
    return CompletionRecord(
        id=cid,
        session_id=session_id,
        parent_id=parent,
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        output_logprobs=np.array([-0.5, -0.25], dtype=np.float32),
        output_versions=[0, 0],
        finish_reason="stop",
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        request_json={"messages": [{"role": "user", "content": cid}]},
        response_json={"choices": [{"index": 0, "message": {"role": "assistant", "content": cid}}]},
    )


TRAJECTORY = TrajectoryRecord(
    token_ids=[1, 2, 3, 4, 5],
    loss_mask=[False] * 3 + [True] * 2,
    logprobs=np.zeros(5, dtype=np.float32),
    versions=[-1, -1, -1, 0, 0],
    reward=1.0,
)
DAY_S = 86_400.0


async def sessions_in_every_state(factory: SessionFactory) -> None:
    """Sessions "consumed" (two turns), "untrained" (finalized without trajectories), "waiting" (one of two
    trajectories consumed), "recent" (consumed, ended just now), "ended" (not finalized) and "active",
    one completion each but "consumed"; all but "recent" ended a day ago."""
    for name in ("consumed", "untrained", "waiting", "recent", "ended", "active"):
        await create_session(factory, SessionRecord(id=name, key_hash=key_hash(name)))
        await record_completions(factory, [completion(f"{name}-1", name)])
    await record_completions(factory, [completion("consumed-2", "consumed", parent="consumed-1")])
    for name in ("consumed", "untrained", "waiting", "recent", "ended"):
        await end_session(factory, name)
    for name, count in (("consumed", 1), ("untrained", 0), ("waiting", 2), ("recent", 1)):
        await insert_trajectories(factory, name, [TRAJECTORY] * count)
    trained = [*await trajectory_ids(factory, "consumed"), *await trajectory_ids(factory, "recent")]
    await consume(factory, [*trained, (await trajectory_ids(factory, "waiting"))[0]], step=1)
    for name in ("consumed", "untrained", "waiting", "ended"):
        await age(factory, name, DAY_S)


async def purged_ids(factory: SessionFactory) -> list[str]:
    async with factory() as db:
        rows = list((await db.execute(select(Completion).order_by(Completion.id))).scalars())
    for row in rows:  # a purge keeps every token
        assert row.prompt_ids.tolist() == [1, 2, 3] and row.output_ids.tolist() == [4, 5]
    return [row.id for row in rows if row.request_json == PURGED and row.response_json == PURGED]


async def test_retention_purges_exactly_the_sessions_trained_on(session_factory: SessionFactory) -> None:
    await sessions_in_every_state(session_factory)
    assert await purge_raw_json(session_factory, 2 * DAY_S) == 0  # all ended too recently for this retention
    assert await purge_raw_json(session_factory, DAY_S / 2, batch=2) == 3  # two batches
    assert await purged_ids(session_factory) == ["consumed-1", "consumed-2", "untrained-1"]
    assert await purge_raw_json(session_factory, DAY_S / 2, batch=2) == 0
    assert len(await session_trajectories(session_factory, "consumed")) == 1


def test_the_cli_purges_once_and_says_how_many(db_url: str, tmp_path: Path) -> None:
    run_db(db_url, sessions_in_every_state)
    refused = flywheel("db", "purge-json", *storage_overrides(db_url), cwd=tmp_path)
    assert refused.returncode == 2 and "--older-than" in refused.stderr
    configured = [f"proxy.privacy.raw_json_retention_s={2 * DAY_S}", *storage_overrides(db_url)]
    too_recent = flywheel("db", "purge-json", *configured, cwd=tmp_path)
    assert too_recent.returncode == 0, too_recent.stderr
    assert too_recent.stdout.strip() == "purged the raw JSON of 0 completion(s)"
    result = flywheel("db", "purge-json", "--older-than", "3600", *configured, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "purged the raw JSON of 3 completion(s)"
    assert run_db(db_url, purged_ids) == ["consumed-1", "consumed-2", "untrained-1"]


def test_the_proxy_purges_a_session_once_it_was_trained_on(
    proxies: ProxyFactory, worker: ScriptedWorker
) -> None:
    retention = {"raw_json_retention_s": 0, "purge_interval_s": 0.05}
    proxy = proxies.start([worker.url], privacy=retention, health_check_interval_s=0)
    other_id, other_key = proxy.new_session_key()
    for key in (proxy.session_key, other_key):
        proxy.client(key).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Just say hello."}]
        )
    for session_id in (proxy.session_id, other_id):
        assert run_db(proxy.db_url, lambda f, s=session_id: reward_end_and_finalize(f, s)) == 1

    def purged(session_id: str) -> bool:
        [row] = session_completions(proxy, session_id)
        return row.request_json == PURGED and row.response_json == PURGED

    run_db(proxy.db_url, lambda f: consume_session(f, proxy.session_id, 1))
    wait_for(lambda: purged(proxy.session_id), "the trained session's purge")
    assert not purged(other_id)  # finalized, but its trajectory is still waiting for the trainer
    run_db(proxy.db_url, lambda f: consume_session(f, other_id, 2))
    wait_for(lambda: purged(other_id), "the second session's purge")
    [row] = session_completions(proxy, other_id)
    assert len(row.output_ids) > 0


async def consume_session(factory: SessionFactory, session_id: str, step: int) -> None:
    await consume(factory, await trajectory_ids(factory, session_id), step)
