"""OpenAI's Codex CLI 0.169.0 (npm `@openai/codex`, its native binary, from `make agents`), unmodified and
with its default tools, against the proxy's Responses API: `codex exec` runs a task that needs one shell
call (its `exec_command` tool reads a file holding a random token), then answers with the token.

Codex offers more than function tools by default: a `namespace` of sub-agent tools and the hosted
`web_search`. The proxy flattens the one into the template and leaves the other out
(proxy/openai/responses/tools.py). Codex's prompt, thousands of tokens of instructions and tool
definitions, is too long for the CPU model, so a scripted worker writes the model's turns with the tiny
model's tokenizer: a `<think>` block and a Hermes tool call, then the answer. Codex sends the reasoning
item back (without encrypted content) with the call and its output; both calls are recorded
token-exactly and chained into one trajectory. Codex is configured as integrations/codex/README.md says
(tests/support/codex_cli.py).

Calls to a namespaced tool and to a custom (freeform) tool such as Codex's `apply_patch` are driven by the
real `openai` client, with requests shaped as Codex sends them: they come back as the items Codex reads
(`function_call` with its `namespace`, `custom_tool_call`), and replayed, chain like any other call."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import pytest

from integrations.codex.config import config_toml
from tests.support.codex_cli import run_codex
from tests.support.finalizing import reward_end_and_finalize, session_trajectories
from tests.support.node_agents import node_agent
from tests.support.proxy_harness import ProxyFactory, install_script, run_db, session_completions
from tests.support.recorded import assert_token_exact, full_prompt_ids, output_text
from tests.support.responses_api import collect_stream
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

REPO = Path(__file__).resolve().parents[2]
README = REPO / "integrations" / "codex" / "README.md"
CONTEXT_LENGTH = 65_536
TOKEN = re.compile(r"fw-token-[0-9a-f]{16}")
THINKING = "<think>\nThe file holds the answer: read it.\n</think>\n\n"
SHELL_CALL = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "cat token.txt"}}\n</tool_call>'
PROMPT = "What does token.txt in the current directory say? Reply with its contents only."

AGENT_TASK = "Ask a helper agent for a greeting, then add it to hello.txt."
PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+Hello\n*** End Patch"
SPAWN_AND_PATCH = (
    '<tool_call>\n{"name": "multi_agent_v1__spawn_agent", "arguments": {"message": "a greeting"}}\n'
    '</tool_call>\n<tool_call>\n' + json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})
    + "\n</tool_call>"
)
DONE = "Added the greeting."
TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawns an agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}]},
    {"type": "custom", "name": "apply_patch", "description": "Edits files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /(.|\\n)*/'}},
    {"type": "web_search", "external_web_access": True},
]


def reply(prompt: str) -> str:
    """For the agent task, a namespaced and a custom tool call, then the answer once their results are in;
    else the shell call until the command's output (the token) is in the prompt, then the token."""
    if AGENT_TASK in prompt:
        return DONE if "<tool_response>" in prompt else SPAWN_AND_PATCH
    found = TOKEN.search(prompt)
    return found.group(0) if found else THINKING + SHELL_CALL


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="codex")
def codex_fixture() -> Path:
    return node_agent("codex")


def test_codex_exec_runs_a_shell_call_through_the_proxy_into_one_trajectory(
    codex: Path, proxies: ProxyFactory, worker: ScriptedWorker, script: TextScript, tmp_path: Path,
) -> None:
    proxy = proxies.start([worker.url], tool_call_parser="hermes", reasoning_parser="qwen3",
                          context_length=CONTEXT_LENGTH)
    (model,) = [m.id for m in proxy.client().models.list()]
    workdir = tmp_path / "work"
    workdir.mkdir()
    token = f"fw-token-{secrets.token_hex(8)}"
    (workdir / "token.txt").write_text(token + "\n")

    run = run_codex(codex, proxy.v1, proxy.session_key, model, PROMPT, tmp_path / "home", workdir,
                    context_window=CONTEXT_LENGTH)

    assert run.returncode == 0, f"codex exec failed:\n{run.stderr[-4000:]}"
    assert run.last_message == token
    (command,) = run.items("command_execution")
    assert "cat token.txt" in command["command"] and token in command["aggregated_output"]

    rows = session_completions(proxy)
    assert_token_exact(rows, worker, script)
    first, second = rows
    assert output_text(first, script) == THINKING + SHELL_CALL and output_text(second, script) == token
    # Codex sent its default tools, hosted and namespaced ones among them, and streamed both calls.
    sent = first.request_json
    assert sent["stream"] is True and {"namespace", "web_search"} <= {tool["type"] for tool in sent["tools"]}
    rendered = [tool["function"]["name"] for tool in sent["chat_view"]["tools"]]
    assert "exec_command" in rendered and "multi_agent_v1__spawn_agent" in rendered
    assert not any("web_search" in name for name in rendered)
    reasoning, call = first.response_json["output"]
    assert [reasoning["type"], call["type"], call["name"]] == ["reasoning", "function_call", "exec_command"]
    assert json.loads(call["arguments"]) == {"cmd": "cat token.txt"}
    replayed = {item.get("type"): item for item in second.request_json["input"]}
    assert replayed["reasoning"]["encrypted_content"] is None
    assert replayed["reasoning"]["content"] == reasoning["content"]
    assert replayed["function_call"]["call_id"] == call["call_id"]
    assert replayed["function_call_output"]["call_id"] == call["call_id"]
    # The answer extends the shell call: its prompt is the first prompt and output, then the tool result.
    assert second.parent_id == first.id and not second.branched
    first_sequence = full_prompt_ids(rows, first) + first.output_ids.tolist()
    assert full_prompt_ids(rows, second)[:len(first_sequence)] == first_sequence
    assert token in script.tokenizer.decode(second.prompt_ids.tolist())

    assert run_db(proxy.db_url, lambda factory: reward_end_and_finalize(factory, proxy.session_id)) == 1
    (trajectory,) = run_db(proxy.db_url, lambda factory: session_trajectories(factory, proxy.session_id))
    assert trajectory.token_ids.tolist() == full_prompt_ids(rows, second) + second.output_ids.tolist()


def test_namespaced_and_custom_tool_calls_come_back_as_codex_reads_them_and_chain(
    proxies: ProxyFactory, worker: ScriptedWorker, script: TextScript,
) -> None:
    proxy = proxies.start([worker.url], tool_call_parser="hermes")
    client = proxy.client()
    opening = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": AGENT_TASK}]},
    ]
    with client.responses.create(model="m", input=opening, tools=TOOLS, stream=True, store=False) as stream:  # type: ignore[arg-type]
        events, first = collect_stream(stream)
    spawn, patch = first.output
    assert (spawn.type, spawn.name, spawn.namespace) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert json.loads(spawn.arguments) == {"message": "a greeting"}
    assert (patch.type, patch.name, patch.input) == ("custom_tool_call", "apply_patch", PATCH)
    deltas = [e for e in events if e.type == "response.custom_tool_call_input.delta"]
    (done,) = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert [e.delta for e in deltas] == [PATCH] and done.input == PATCH and done.item_id == patch.id

    # Codex sends the whole history back, the calls as they came, then their outputs.
    history = [*opening, *(item.model_dump(exclude_none=True) for item in first.output),
               {"type": "function_call_output", "call_id": spawn.call_id, "output": "agent-1: Hello"},
               {"type": "custom_tool_call_output", "call_id": patch.call_id, "output": "Done!"}]
    answer = client.responses.create(model="m", input=history, tools=TOOLS, store=False)  # type: ignore[arg-type]
    assert answer.output_text == DONE

    rows = session_completions(proxy)
    assert_token_exact(rows, worker, script)
    assert [r.id for r in rows] == [first.id, answer.id]
    assert rows[1].parent_id == first.id and not rows[1].branched
    assert output_text(rows[0], script) == SPAWN_AND_PATCH


def test_the_readme_shows_the_config_the_test_runs() -> None:
    """The README's config.toml is `integrations.codex.config` output, placeholders and all."""
    block = README.read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    assert block == config_toml("http://127.0.0.1:8000/v1", "MODEL", 65536)
