"""OpenClaw 2026.9.6 (npm `openclaw`, the real CLI, on Node 24 from `make agents`), unmodified, against the
proxy: `openclaw agent exec` runs a task that reads a file with its `read` tool, then answers.

The scripted model calls `read`, then answers with what the tool returned (OpenClaw's prompt, a
~22k-character system prompt and 11 tools, is too long for a CPU model). OpenClaw appends an internal-
context user message to every request and leaves it out of the next one; the proxy treats it as
ephemeral context, so the task is one chained, token-exact trajectory with that message never trained,
on a session key (`python -m integrations.openclaw tasks`, graded by the `exact` hook) as on an online
key, where a two-message `openclaw agent --local` conversation (config written by `flywheel openclaw
config`) is one session, judged by `python -m integrations.openclaw feedback`: the commands of
integrations/openclaw/README.md.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from storage.models import Completion, Trajectory
from tests.support.feedback import feedback_rows, new_online_key
from tests.support.node_agents import node_agent, node_env
from tests.support.proxy_harness import Proxy, ProxyFactory, install_script, run_db, session_completions
from tests.support.recorded import assert_token_exact, full_prompt_ids, output_text
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

REPO = Path(__file__).resolve().parents[2]
CONTEXT_LENGTH = 262_144  # far from full: OpenClaw compacts (rewrites) a history that nears its window
INTERNAL_CONTEXT = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
READ = '<tool_call>\n{"name": "read", "arguments": {"path": "hello.txt"}}\n</tool_call>'
PROMPT = "Read hello.txt and reply with its contents only."

pytestmark = pytest.mark.slow


def reply(prompt: str) -> str:
    """Call `read` first; once its result is in the prompt, answer with it."""
    found = re.findall(r"<tool_response>\s*(.*?)\s*</tool_response>", prompt, re.S)
    return found[-1].strip() if found else READ


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="openclaw")
def openclaw_fixture() -> Path:
    return node_agent("openclaw")


def wait_for_trajectories(proxy: Proxy, session_id: str, timeout_s: float = 60.0) -> list[Trajectory]:
    async def load(factory: Any) -> list[Trajectory]:
        async with factory() as db:
            query = select(Trajectory).where(Trajectory.session_id == session_id)
            return list((await db.scalars(query)).all())

    deadline = time.monotonic() + timeout_s
    while not (found := run_db(proxy.db_url, load)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return found


def assert_one_chained_task(rows: list[Completion], script: TextScript) -> None:
    """The task's two calls: the second extends the first, leaving out the first's trailing internal
    context (OpenClaw re-sends it fresh), without a branch."""
    first, second = rows
    assert output_text(first, script) == READ
    opening = first.request_json["messages"]
    assert INTERNAL_CONTEXT in json.dumps(opening[-1]) and opening[-1]["role"] == "user"
    assert second.parent_id == first.id and second.dropped_messages == 1 and not second.branched
    # The second call's record holds only what it added: the tool result and the fresh internal context.
    assert [m["role"] for m in second.request_json["messages"]] == ["tool", "user"]
    assert INTERNAL_CONTEXT in json.dumps(second.request_json["messages"][-1])


def test_a_task_is_one_chained_token_exact_trajectory_graded_by_a_hook(
    openclaw: Path, proxies: ProxyFactory, worker: ScriptedWorker, script: TextScript, tmp_path: Path,
) -> None:
    proxy = proxies.start([worker.url], context_length=CONTEXT_LENGTH)
    answer = f"hello-{secrets.token_hex(4)}"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "read-file", "prompt": PROMPT, "answer": answer,
                                 "files": {"hello.txt": answer + "\n"}}) + "\n")
    report = tmp_path / "report.json"
    done = subprocess.run(  # the README's command
        [sys.executable, "-m", "integrations.openclaw", "tasks", "--base-url", proxy.base_url,
         "--api-key", proxy.admin_key, "--tasks", str(tasks), "--openclaw", str(openclaw),
         "--timeout-s", "240", "--report", str(report)],
        capture_output=True, text=True, timeout=400, check=False, cwd=REPO,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    (result,) = json.loads(report.read_text())
    assert result["ok"] and result["error"] is None, result
    assert result["final"] == answer and result["tools"] == ["read"] and result["assistant_turns"] == 2
    assert result["reward"] == 1.0  # the hook graded the ended session against the task's answer
    rows = session_completions(proxy, result["session_id"])
    assert_one_chained_task(rows, script)
    assert_token_exact(rows, worker, script)
    assert all(row.request_json["stream"] is True for row in rows)

    # One trajectory: the second call's whole sequence, both answers trained, every prompt token (the
    # first call's internal context among them) masked.
    (trajectory,) = wait_for_trajectories(proxy, result["session_id"])
    first, second = rows
    first_prompt = full_prompt_ids(rows, first)
    sequence = [*full_prompt_ids(rows, second), *second.output_ids.tolist()]
    assert trajectory.token_ids.tolist() == sequence and trajectory.reward == 1.0
    trained = [i for i, masked in enumerate(trajectory.loss_mask.tolist()) if masked]
    first_output = range(len(first_prompt), len(first_prompt) + len(first.output_ids))
    second_output = range(len(sequence) - len(second.output_ids), len(sequence))
    assert trained == [*first_output, *second_output]
    assert INTERNAL_CONTEXT in script.tokenizer.decode(first_prompt)
    # What chaining saves: the two calls as separate samples would carry the whole prompt twice.
    separate = len(first_prompt) + len(first.output_ids) + len(sequence)
    assert len(sequence) < separate * 0.6


def chat_turn(openclaw: Path, config: Path, state: Path, message: str) -> dict[str, Any]:
    """One message of an interactive OpenClaw conversation (`openclaw agent --local`), as the README
    shows; the conversation goes on in OpenClaw's own session `chat`."""
    done = subprocess.run(
        [str(openclaw), "agent", "--local", "--session-id", "chat", "-m", message, "--json"],
        env=node_env(OPENCLAW_CONFIG_PATH=str(config), OPENCLAW_STATE_DIR=str(state), HOME=str(state.parent)),
        cwd=state.parent / "workspace", capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    envelope: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{"):])
    return envelope


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # the task test covers Postgres
def test_on_an_online_key_a_conversation_is_one_session_and_takes_feedback(
    openclaw: Path, proxies: ProxyFactory, worker: ScriptedWorker, script: TextScript, tmp_path: Path,
) -> None:
    proxy = proxies.start([worker.url], context_length=CONTEXT_LENGTH)
    key = new_online_key(proxy)
    config = tmp_path / "openclaw.json"
    config.write_text(json.dumps({"agents": {"defaults": {"workspace": str(tmp_path / "workspace")}}}))
    written = subprocess.run(  # the README's command, merging into an existing config
        [sys.executable, "-m", "flywheel.cli", "openclaw", "config", "--key", key, "--out", str(config),
         "--base-url", proxy.base_url, f"run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
    )
    assert written.returncode == 0, written.stderr
    merged = json.loads(config.read_text())
    assert merged["agents"]["defaults"]["workspace"] == str(tmp_path / "workspace")  # kept
    (model,) = merged["models"]["providers"]["flywheel"]["models"]
    assert model["contextWindow"] == CONTEXT_LENGTH  # read from the running proxy with the key
    (tmp_path / "workspace").mkdir()
    (tmp_path / "state").mkdir()
    (tmp_path / "workspace" / "hello.txt").write_text("online answer\n")
    first = chat_turn(openclaw, config, tmp_path / "state", PROMPT)
    assert first["payloads"][0]["text"] == "online answer", first
    chat_turn(openclaw, config, tmp_path / "state", "Thanks. Say it once more.")

    sessions = [s for s in proxy.sessions() if s.owner_key_hash is not None]
    assert len(sessions) == 1  # one conversation, one session: every call extends the one before
    rows = session_completions(proxy, sessions[0].id)
    assert len(rows) == 3
    assert_one_chained_task(rows[:2], script)
    assert rows[2].parent_id == rows[1].id and rows[2].dropped_messages == 1 and not rows[2].branched
    assert_token_exact(rows, worker, script)

    judged = subprocess.run(  # the README's command
        [sys.executable, "-m", "integrations.openclaw", "feedback", "--base-url", proxy.base_url,
         "--api-key", key, "--thumbs", "up", "--comment", "read the right file"],
        capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
    )
    assert judged.returncode == 0, judged.stderr
    (feedback,) = feedback_rows(proxy)
    assert (feedback.completion_id, feedback.thumbs) == (rows[-1].id, "up")
    assert feedback.session_id == sessions[0].id


def test_a_rewritten_history_still_branches(proxy: Proxy) -> None:
    """An agent that sends its tool calls back as text (smolagents) changed its history: the ephemeral
    rule does not apply, the call is a flagged branch."""
    client = proxy.client()
    system = {"role": "system", "content": "You are an agent."}
    task = {"role": "user", "content": "What is 6 x 7?"}
    context = {"role": "user", "content": "<<<CONTEXT>>> turn 1 <<<END>>>"}
    client.chat.completions.create(model="m", messages=[system, task, context], max_tokens=8)
    as_text = [system, task, {"role": "assistant", "content": "Calling tools: multiply(6, 7)"},
               {"role": "user", "content": "Observation: 42"}]
    client.chat.completions.create(model="m", messages=as_text, max_tokens=8)
    first, second = session_completions(proxy)
    assert second.parent_id is None and second.branched and second.dropped_messages == 0
    assert first.session_id == second.session_id

