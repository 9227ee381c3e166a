"""Several proxies on one Postgres database, as operators run them behind a load balancer: nothing a call,
a reward or a finalization needs may be known to one replica only.

- One session's turns served round-robin by two replicas (real `openai` client, one scripted worker)
  chain into one token-exact sequence, even though each replica's tree of the session misses the turns
  the other served and every answer has the same text; rewarded through one, ended through the other,
  with both finalizers sweeping, it becomes one trajectory.
- An online key's conversation alternating replicas stays one session; two replicas opening one
  conversation hint at once make one session.
- Two finalizers (two processes' engines) sweeping at once finalize a session once; a reward written by
  another replica while a finalization builds is in the trajectories, and one written after it is
  refused.
- An online call finds its session from any replica, when the trees held there are empty or shallower.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

from proxy.conversations.index import ConversationIndex
from proxy.conversations.online import find_online_session
from proxy.openai import pipeline
from rewards import finalizer as finalizer_module
from rewards.config import FinalizerConfig
from rewards.finalizer import SessionFinalizer
from storage.config import StorageConfig
from storage.engine import SessionFactory, create_engine, create_sessionmaker
from storage.migrate import upgrade
from storage.models import Session, Trajectory
from storage.queries import (
    SessionFinalizedError,
    add_reward,
    create_session,
    end_session,
    record_completions,
)
from storage.records import CompletionRecord, SessionRecord
from tests.support.databases import key_hash, run_outside_loop
from tests.support.feedback import SESSION_HEADER, new_online_key, rl, wait_for_status
from tests.support.proxy_harness import Proxy, ProxyFactory, install_script, run_db, session_completions
from tests.support.recorded import assert_token_exact, full_prompt_ids
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

pytestmark = pytest.mark.postgres

ANSWER = "OK."
"""Every answer: a turn one replica missed has a text its tree knows (the dangerous stale case)."""
TURNS = 5


@pytest.fixture(name="db_url")
def postgres_db_url_fixture(empty_postgres_url: str) -> str:
    """Postgres only: the deployment several replicas share."""
    run_outside_loop(upgrade, empty_postgres_url)
    return empty_postgres_url


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, lambda _prompt: ANSWER, monkeypatch)


@pytest.fixture(name="replicas")
def replicas_fixture(
    db_url: str, tiny_model_dir: Path, worker: ScriptedWorker
) -> Iterator[tuple[Proxy, Proxy]]:
    """Two proxies on one database in front of one worker, each sweeping for sessions to finalize often."""
    factory = ProxyFactory(db_url, tiny_model_dir)
    settings: dict[str, Any] = {"health_check_interval_s": 0, "finalizer": {"sweep_interval_s": 0.05}}
    with factory.stack:
        yield factory.start([worker.url], **settings), factory.start([worker.url], **settings)


def chat(replica: Proxy, key: str, messages: list[dict[str, Any]], *, stream: bool = False,
         hint: str | None = None) -> tuple[str, str]:
    """(session id, answer text) of one chat call on `replica` with `key`."""
    headers = {"X-Flywheel-Conversation": hint} if hint else None
    raw = replica.client(key).chat.completions.with_raw_response.create(
        model="m", messages=messages, stream=stream, extra_headers=headers,  # type: ignore[call-overload]
    )
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    return raw.headers[SESSION_HEADER], text


def round_robin(replicas: tuple[Proxy, Proxy], key: str) -> list[str]:
    """TURNS calls of one conversation, turn i on replica i mod 2, each extending the last answer; the
    session each call was served in."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me."}]
    sessions = []
    for index in range(TURNS):
        session_id, text = chat(replicas[index % 2], key, messages, stream=index == 3)
        assert text == ANSWER
        sessions.append(session_id)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Now {index + 2}."}]
    return sessions


def assert_one_chain(rows: list[Any]) -> None:
    assert len(rows) == TURNS
    assert rows[0].parent_id is None
    assert [row.parent_id for row in rows[1:]] == [row.id for row in rows[:-1]]
    assert not any(row.branched for row in rows)


def test_a_session_served_round_robin_by_two_replicas_is_one_chain_finalized_once(
    replicas: tuple[Proxy, Proxy], worker: ScriptedWorker, script: TextScript
) -> None:
    a, b = replicas
    assert set(round_robin(replicas, a.session_key)) == {a.session_id}

    rows = session_completions(a)
    assert_one_chain(rows)  # each replica reloaded the turns the other served before chaining
    assert_token_exact(rows, worker, script)

    path = f"/rl/v1/sessions/{a.session_id}"
    assert rl(a, "POST", f"{path}/reward", a.session_key, {"value": 1.0}).status_code == 200
    assert rl(b, "POST", f"{path}/end", a.session_key).status_code == 200
    wait_for_status(b, a.session_id, "finalized", timeout_s=20)  # B's end, and both replicas' sweeps

    [trajectory] = run_db(a.db_url, lambda factory: _trajectories(factory, a.session_id))
    last = rows[-1]
    expected = [*full_prompt_ids(rows, last), *last.output_ids.tolist()]
    assert trajectory.token_ids.tolist() == expected  # one sequence: prompt + every output, chained
    trained = np.flatnonzero(trajectory.loss_mask)
    assert len(trained) == sum(len(row.output_ids) for row in rows)
    assert trajectory.reward == 1.0


def test_an_online_conversation_alternating_replicas_stays_one_session(
    replicas: tuple[Proxy, Proxy], worker: ScriptedWorker, script: TextScript
) -> None:
    a, _b = replicas
    key = new_online_key(a)
    [session_id] = set(round_robin(replicas, key))

    owned = [s for s in a.sessions() if s.owner_key_hash is not None]
    assert [s.id for s in owned] == [session_id]
    rows = session_completions(a, session_id)
    assert_one_chain(rows)
    assert_token_exact(rows, worker, script)


def test_two_replicas_opening_one_conversation_hint_share_its_session(
    replicas: tuple[Proxy, Proxy], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = replicas
    key = new_online_key(a)
    first = [{"role": "user", "content": "Hello."}]
    opened, _ = chat(a, key, first, hint="thread-7")

    # B looks for the hint's session before A's is committed (simulated: its first look finds none).
    looks: list[str] = []
    found = pipeline.hinted_session

    async def late_look(*args: Any) -> str | None:
        looks.append("look")
        return None if len(looks) == 1 else await found(*args)

    monkeypatch.setattr(pipeline, "hinted_session", late_look)
    joined, _ = chat(b, key, first, hint="thread-7")

    assert joined == opened and len(looks) == 2  # refused by the database, then planned in A's session
    hinted = [s for s in a.sessions() if s.conversation == "thread-7"]
    assert [s.id for s in hinted] == [opened]
    assert {row.session_id for row in a.completions()} == {opened}


# Finalizers of two processes: each its own engine on the database.


async def _trajectories(factory: SessionFactory, session_id: str) -> list[Trajectory]:
    async with factory() as db:
        query = select(Trajectory).where(Trajectory.session_id == session_id).order_by(Trajectory.id)
        return list((await db.execute(query)).scalars())


async def _status(factory: SessionFactory, session_id: str) -> str | None:
    async with factory() as db:
        return await db.scalar(select(Session.status).where(Session.id == session_id))


def _turn(
    cid: str, session_id: str, question: str, answer: str, parent: str | None = None
) -> CompletionRecord:
    """A recorded chat completion: `question` answered with `answer`."""
    return CompletionRecord(
        id=cid, session_id=session_id, parent_id=parent, prompt_ids=[1, 2], output_ids=[3, 4],
        output_logprobs=[-0.5, -0.25], output_versions=[0, 0], finish_reason="stop", temperature=1.0,
        top_p=1.0, top_k=-1, request_json={"messages": [{"role": "user", "content": question}]},
        response_json={"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]},
    )


async def _ended_session(factory: SessionFactory, session_id: str, reward: float | None) -> None:
    await create_session(factory, SessionRecord(id=session_id, key_hash=key_hash(session_id)))
    await record_completions(factory, [_turn(f"{session_id}-1", session_id, "Hi.", ANSWER)])
    if reward is not None:
        await add_reward(factory, reward, session_id=session_id)
    await end_session(factory, session_id)


@pytest.fixture(name="peer")
async def peer_fixture(db_url: str) -> Any:
    """A second process's session factory on the test's database (its own engine and connections)."""
    engine = create_engine(StorageConfig(url=db_url))
    yield create_sessionmaker(engine)
    await engine.dispose()


def _after_snapshots(
    monkeypatch: pytest.MonkeyPatch, then: Callable[[], Awaitable[object]], times: int = 1
) -> None:
    """Make the finalizer's first `times` snapshot reads run `then` once they return."""
    read = finalizer_module.load_session_snapshot
    calls = [0]

    async def snapshot(*args: Any, **kwargs: Any) -> Any:
        found = await read(*args, **kwargs)
        calls[0] += 1
        if calls[0] <= times:
            await then()
        return found

    monkeypatch.setattr(finalizer_module, "load_session_snapshot", snapshot)


async def test_two_processes_sweeping_at_once_finalize_a_session_once(
    session_factory: SessionFactory, peer: SessionFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _ended_session(session_factory, "sess-swept", reward=1.0)
    both_read = asyncio.Barrier(2)
    _after_snapshots(monkeypatch, both_read.wait, times=2)  # both build before either writes

    config = FinalizerConfig(sweep_interval_s=60)
    async with asyncio.timeout(30):  # both must reach the barrier: never hang on a regression
        swept = await asyncio.gather(SessionFinalizer(session_factory, config).sweep(),
                                     SessionFinalizer(peer, config).sweep())

    assert sorted(swept) == [0, 1]  # finalized by one sweep; the other found it done and wrote nothing
    assert len(await _trajectories(session_factory, "sess-swept")) == 1
    assert await _status(peer, "sess-swept") == "finalized"


async def test_a_reward_another_process_writes_while_finalizing_is_trained_on(
    session_factory: SessionFactory, peer: SessionFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _ended_session(session_factory, "sess-late", reward=None)

    async def reward_elsewhere() -> None:  # another replica accepts a reward after the snapshot
        await add_reward(peer, 1.0, session_id="sess-late")

    _after_snapshots(monkeypatch, reward_elsewhere)
    assert await SessionFinalizer(session_factory, FinalizerConfig()).finalize("sess-late") == 1

    [trajectory] = await _trajectories(session_factory, "sess-late")
    assert trajectory.reward == 1.0  # built again with it, not finalized as unrewarded
    with pytest.raises(SessionFinalizedError):  # from now on a reward could not count: refused
        await add_reward(peer, 2.0, completion_id="sess-late-1")


# An online call's session, found from a replica whose trees are behind.

OWNER = key_hash("online-key")


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


async def _owned_session(factory: SessionFactory, session_id: str) -> None:
    await create_session(factory, SessionRecord(id=session_id, key_hash=key_hash(session_id),
                                                 owner_key_hash=OWNER))


async def test_an_empty_tree_held_here_does_not_hide_a_session_another_replica_recorded(
    session_factory: SessionFactory,
) -> None:
    here = ConversationIndex(session_factory)
    await _owned_session(session_factory, "sess-new")  # opened by the other replica, not yet recorded
    other = [_user("Elsewhere?"), _assistant("Not here."), _user("Sure?")]
    assert await find_online_session(here, session_factory, OWNER, other, None) is None
    assert here.holds("sess-new")  # loaded while it had no completion

    await record_completions(session_factory, [_turn("new-1", "sess-new", "Plan.", ANSWER)])
    call = [_user("Plan."), _assistant(ANSWER), _user("Go on.")]
    assert await find_online_session(here, session_factory, OWNER, call, None) == "sess-new"


async def test_a_shallower_match_held_here_does_not_beat_a_deeper_session_elsewhere(
    session_factory: SessionFactory,
) -> None:
    here = ConversationIndex(session_factory)
    await _owned_session(session_factory, "sess-x")
    await record_completions(session_factory, [_turn("x-1", "sess-x", "Plan.", ANSWER),
                                               _turn("x-2", "sess-x", "By train.", "Fine.", parent="x-1")])
    x_call = [_user("Plan."), _assistant(ANSWER), _user("By train."), _assistant("Fine."), _user("When?")]
    assert await find_online_session(here, session_factory, OWNER, x_call, None) == "sess-x"

    # Another replica serves a second conversation of the key opening the same way.
    await _owned_session(session_factory, "sess-y")
    await record_completions(session_factory, [_turn("y-1", "sess-y", "Plan.", ANSWER),
                                               _turn("y-2", "sess-y", "By boat.", "Sure.", parent="y-1")])
    y_call = [_user("Plan."), _assistant(ANSWER), _user("By boat."), _assistant("Sure."), _user("When?")]
    assert await find_online_session(here, session_factory, OWNER, y_call, None) == "sess-y"
