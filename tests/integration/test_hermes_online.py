"""Hermes Agent on the online loop: the terminal chat of integrations/hermes (hermes-agent 0.19.0 from
PyPI, unmodified, in its own venv) talks through the real proxy on an online key to a CPU engine serving
the tiny model, while the trainer runs with eval-gated promotion. A scripted person holds one two-turn
conversation, judges each turn (/good, /score 1) and quits; the chat's feedback becomes rewards on each
turn's last completion, the ended session trains, and the new version passes its evaluation and is
served. (The tiny model's answers always hit the token limit, so hermes-agent asks each to continue: a
turn is several calls.)"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from rewards.config import FinalizerConfig, RewardsConfig
from serving.client import WorkerPool
from serving.config import ClientConfig
from serving.models.loading import load_tokenizer
from storage.engine import SessionFactory
from storage.models import Completion, Feedback, PolicyVersion, Session, Trajectory
from tests.support.databases import key_hasher
from tests.support.feedback import new_online_key
from tests.support.online_loop import LocalPolicy, gated_driver, online_trainer_config, two_engines
from tests.support.proxy_harness import ProxyFactory

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHAT = REPO / "integrations" / "hermes" / "chat.py"
CONTEXT_LENGTH = 100_000  # hermes-agent refuses a model whose context is below 64K tokens
SCRIPT = "Hello there.\n/good\nTell me more.\n/score 1\n/quit\n"
PROMOTION_DEADLINE_S = 120.0



@pytest.fixture
def engines(tiny_model_dir: Path) -> Iterator[tuple[str, str]]:
    """(serving worker, eval worker), taking hermes-agent's long prompts."""
    with two_engines(tiny_model_dir, context_length=CONTEXT_LENGTH) as urls:
        yield urls


def no_nul_bias(model_dir: Path) -> dict[str, int]:
    """A logit bias that keeps the model from writing NUL characters. hermes-agent asks a truncated
    answer (the random model's always are) to continue, sending the truncated part back in the same
    turn, where the chat cannot clean it; the proxy refuses a NUL in a request, and hermes-agent gives up
    the turn. (Between turns the chat strips NULs from the history itself.)"""
    tokenizer = load_tokenizer(model_dir)
    return {str(i): -100 for i in range(len(tokenizer)) if "\x00" in tokenizer.decode([i])}


def run_chat(python: Path, base_url: str, key: str, home: Path, script: str, overrides: str = "{}") -> str:
    """The chat front end with `script` as its input; its output."""
    home.mkdir(exist_ok=True)
    env = {**os.environ, "HOME": str(home), "HERMES_HOME": str(home / ".hermes")}
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENROUTER_API_KEY", "FLYWHEEL_ONLINE_KEY"):
        env.pop(name, None)  # the arguments are the only endpoint and key
    arguments = [
        "--base-url",
        base_url,
        "--api-key",
        key,
        "--max-tokens",
        "16",
        "--request-overrides",
        overrides,
    ]
    done = subprocess.run(
        [str(python), str(CHAT), *arguments],
        input=script,
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"the chat failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


async def _served(session_factory: SessionFactory, deadline_s: float) -> PolicyVersion:
    """The first trained version to be promoted and served."""
    deadline = asyncio.get_running_loop().time() + deadline_s
    while asyncio.get_running_loop().time() < deadline:
        async with session_factory() as db:
            versions = (await db.scalars(select(PolicyVersion).order_by(PolicyVersion.version))).all()
        served = [v for v in versions if v.version > 0 and v.status == "promoted" and v.served_at]
        if served:
            return served[0]
        await asyncio.sleep(0.5)
    described = [(v.version, v.status, v.eval_score, v.reason) for v in versions]
    raise AssertionError(f"no trained version was promoted and served within {deadline_s:.0f} s: {described}")


async def test_hermes_chat_feedback_trains_a_version_that_is_promoted_and_served(
    hermes_python: Path,
    proxies: ProxyFactory,
    engines: tuple[str, str],
    db_url: str,
    session_factory: SessionFactory,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    serving_url, eval_url = engines
    finalizer = FinalizerConfig(reward_grace_s=1.0, session_ttl_s=20.0, sweep_interval_s=0.5)
    proxy = proxies.start(
        [serving_url], rewards=RewardsConfig(), finalizer=finalizer, context_length=CONTEXT_LENGTH
    )
    hasher = key_hasher(db_url)
    key = new_online_key(proxy)
    config = online_trainer_config(batch_size=1, margin=10.0)  # eval scores lie in 0..1: any version passes
    stop = asyncio.Event()
    policy = LocalPolicy(tiny_model_dir, config)
    async with gated_driver(
        config, session_factory, policy, serving_url, eval_url, tiny_model_dir, tmp_path, max_new_tokens=8
    ) as driver:
        training = asyncio.create_task(driver.run(stop))
        try:
            overrides = json.dumps({"logit_bias": no_nul_bias(tiny_model_dir)})
            transcript = await asyncio.to_thread(
                run_chat, hermes_python, proxy.base_url, key, tmp_path / "home", SCRIPT, overrides
            )
            first_served = await _served(session_factory, PROMOTION_DEADLINE_S)
        finally:
            stop.set()
            await asyncio.wait_for(training, 120)
    async with WorkerPool(ClientConfig(), [serving_url]) as pool:
        info = await pool.clients[0].model_info()
    # The chat reads the served version too (it makes no agent for /policy alone).
    later = await asyncio.to_thread(
        run_chat, hermes_python, proxy.base_url, key, tmp_path / "home", "/policy\n/quit\n"
    )

    # The conversation is one session of the online key, tagged with the chat's conversation id. Each
    # turn took several calls (hermes-agent asks a truncated answer to go on); hermes-agent strips the
    # whitespace around the answers it sends back, which prefix matching ignores, so later calls chain.
    owner = hasher.hash(key)
    async with session_factory() as db:
        sessions = (await db.scalars(select(Session).where(Session.owner_key_hash == owner))).all()
        assert len(sessions) == 1, [(s.id, s.conversation) for s in sessions]
        (session,) = sessions
        completions = (
            await db.scalars(
                select(Completion).where(Completion.session_id == session.id).order_by(Completion.created_at)
            )
        ).all()
        feedback = (await db.scalars(select(Feedback).order_by(Feedback.id))).all()
        trajectories = (await db.scalars(select(Trajectory))).all()
    assert (session.conversation or "").startswith("hermes-chat-")
    assert session.status == "finalized"
    assert completions[0].parent_id is None and not completions[0].branched
    # Every later call chains onto an earlier answer or, where the random model's text did not survive
    # the round trip through hermes-agent, is a flagged branch of the same session; none is a new root.
    links = [(c.parent_id is not None, c.branched) for c in completions[1:]]
    assert all(linked or branched for linked, branched in links) and any(linked for linked, _ in links), links
    assert "Hello there." in json.dumps(completions[0].request_json)

    # Each turn's feedback landed on that turn's last completion (the key's newest then), and counted.
    second_turn = next(i for i, c in enumerate(completions) if "Tell me more." in json.dumps(c.request_json))
    first_turn = completions[:second_turn]
    assert first_turn
    assert [(f.completion_id, f.thumbs, f.value, f.state) for f in feedback] == [
        (first_turn[-1].id, "up", 1.0, "applied"),
        (completions[-1].id, None, 1.0, "applied"),
    ]
    assert all(f.session_id == session.id and f.key_hash == owner for f in feedback)
    assert transcript.count("[flywheel] feedback applied") == 2, transcript
    assert f"session {session.id} ended" in transcript
    assert trajectories and all(t.session_id == session.id for t in trajectories)
    assert any(t.consumed_step is not None for t in trajectories)

    # The trained version passed its evaluation and is what the engine and the proxy serve.
    assert first_served.eval_score is not None and first_served.parent_version == 0
    async with httpx.AsyncClient(base_url=proxy.base_url) as http:
        view = (await http.get("/rl/v1/policy", headers={"Authorization": f"Bearer {key}"})).json()
    assert view["policy_version"] >= first_served.version > 0
    assert view["served"]["status"] == "promoted"
    assert info["weight_version"] == str(view["policy_version"])
    assert f"policy: serving v{view['policy_version']}" in later, later
