"""hermes-agent 0.19.0 from PyPI, unmodified, against the real proxy: `AIAgent(base_url=..., api_key=...)`
`.run_conversation(...)` probes the model (LM Studio's /api/v1/models, Ollama's /api/show, /v1/models/{id}),
then streams chat completions with its tools. The scripted model calls hermes-agent's in-memory `todo`
tool once, then answers; the session keeps both completions token-exactly.

hermes-agent pins openai 2.x, so it runs from its own venv (`make agents` builds .venv-agents/hermes) in a
subprocess (tests/support/hermes_driver.py) with HOME and HERMES_HOME in a temporary directory."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.proxy_harness import Proxy, ProxyFactory, install_script
from tests.support.recorded import assert_token_exact, output_text
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "tests" / "support" / "hermes_driver.py"
CONTEXT_LENGTH = 100_000  # hermes-agent refuses tool use below 64K; an odd value shows it read the probes
TODOS = [{"id": "1", "content": "Greet the user", "status": "completed"}]
CALL = '<tool_call>\n' + json.dumps({"name": "todo", "arguments": {"todos": TODOS}}) + '\n</tool_call>'
ANSWER = "Hello! The plan is done."
QUESTION = "Plan a greeting with your todo tool, then greet me."


def reply(prompt: str) -> str:
    return ANSWER if "<tool_response>" in prompt else CALL



@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


def run_hermes(python: Path, proxy: Proxy, home: Path) -> dict[str, Any]:
    """One conversation on the served model's name, as a user would configure it from /v1/models."""
    (model,) = [m.id for m in proxy.client().models.list()]
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "HERMES_HOME": str(home / ".hermes")}
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENROUTER_API_KEY"):
        env.pop(name, None)  # the driver's arguments are the only endpoint and key
    done = subprocess.run(
        [str(python), str(DRIVER), "--base-url", proxy.v1, "--api-key", proxy.session_key,
         "--model", model, "--toolsets", "todo", QUESTION],
        env=env, cwd=home, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, f"hermes driver failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_hermes_agent_runs_a_tool_conversation_through_the_proxy(
    hermes_python: Path, proxies: ProxyFactory, worker: ScriptedWorker, script: TextScript, tmp_path: Path,
) -> None:
    proxy = proxies.start([worker.url], context_length=CONTEXT_LENGTH)
    result = run_hermes(hermes_python, proxy, tmp_path / "home")

    assert result["completed"] is True and not result["failed"], result["error"]
    assert result["final_response"] == ANSWER
    assert result["tools"] == ["todo"] and result["version"] == "0.19.0"
    assert result["api_calls"] == 2
    # The probes answered: hermes-agent took the proxy's context length from them (it finds an LM Studio
    # at /api/v1/models; without an answer it assumes 256,000).
    assert result["context_length"] == CONTEXT_LENGTH
    assistant, tool = result["messages"][1:3]
    (call,) = assistant["tool_calls"]
    assert call["function"]["name"] == "todo"
    assert json.loads(call["function"]["arguments"]) == {"todos": TODOS}
    assert tool["role"] == "tool" and tool["tool_call_id"] == call["id"]
    assert json.loads(tool["content"])["todos"] == TODOS  # hermes-agent really ran its tool

    # Both calls are recorded in the session, token-exactly: the prompt ids the worker got and the ids
    # it generated. hermes-agent streams, so the answers went out as chunks.
    rows = proxy.completions()
    assert_token_exact(rows, worker, script)
    for row in rows:
        assert row.session_id == proxy.session_id and row.finish_reason == "stop"
        assert row.request_json["stream"] is True
    first, second = rows
    # The second call continues the first (docs/architecture.md, "The token-exact rule"): one trajectory,
    # no branch.
    assert second.parent_id == first.id and not second.branched
    assert output_text(first, script) == CALL and output_text(second, script) == ANSWER
    assert [t["function"]["name"] for t in first.request_json["tools"]] == ["todo"]
    assert first.response_json["choices"][0]["message"]["tool_calls"][0]["id"] == call["id"]
    assert "<tool_response>" in script.tokenizer.decode(second.prompt_ids.tolist())
