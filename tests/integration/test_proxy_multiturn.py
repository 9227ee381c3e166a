"""Token-exact multi-turn conversations through the real proxy and the real `openai` client: each turn's
prompt is the previous turn's prompt + output + the rendered suffix (the scripted worker sees exactly
that), recorded as a chain of suffixes; an edited history branches; a restarted proxy still chains; the
finalizer exports the chain as one trajectory with only the generated tokens trained."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.openai.schemas import ChatCompletionRequest
from proxy.tokenize import load_chat_tokenizer
from storage.models import Completion
from tests.support.chat_stream import assemble_stream
from tests.support.finalizing import reward_end_and_finalize, session_trajectories
from tests.support.proxy_harness import (
    Proxy,
    ProxyFactory,
    install_script,
    metric,
    run_db,
    session_completions,
)
from tests.support.qwen3_template import QWEN3_STYLE_TEMPLATE
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

TOOLS = [{
    "type": "function",
    "function": {"name": "lookup", "description": "Look up a step.",
                 "parameters": {"type": "object", "properties": {"step": {"type": "integer"}}}},
}]
SYSTEM = {"role": "system", "content": "You look things up."}
QUESTION = {"role": "user", "content": "Do the three lookups."}
SUMMARIZE = {"role": "user", "content": "Summarize."}
LOOKUPS = 3


def tool_call_text(step: int) -> str:
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"step": {step}}}}}\n</tool_call>'


def agent_reply(thinking: bool) -> Any:
    """Three lookups, one per tool result, then an answer; a summary when asked. With `thinking` each
    reply opens with a <think> block."""

    def reply(prompt: str) -> str:
        done = prompt.count("<tool_response>")
        think = f"<think>\nstep {done}\n</think>\n\n" if thinking else ""
        if prompt.rstrip().endswith("Summarize.<|im_end|>\n<|im_start|>assistant"):
            return think + "Three lookups."
        return think + (tool_call_text(done) if done < LOOKUPS else "All done.")

    return reply


@pytest.fixture(name="qwen3_model_dir", scope="module")
def qwen3_model_dir_fixture(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Qwen3-style chat template that drops earlier <think> blocks."""
    model_dir = tmp_path_factory.mktemp("qwen3-style") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)
    return model_dir


@pytest.fixture(name="thinking", params=[False, True], ids=["chatml", "qwen3-style"])
def thinking_fixture(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture(name="model_dir")
def model_dir_fixture(thinking: bool, tiny_model_dir: Path, qwen3_model_dir: Path) -> Path:
    return qwen3_model_dir if thinking else tiny_model_dir


@pytest.fixture(name="script")
def script_fixture(model_dir: Path, thinking: bool, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(model_dir, agent_reply(thinking), monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(db_url: str, model_dir: Path, worker: ScriptedWorker, thinking: bool) -> Iterator[Proxy]:
    factory = ProxyFactory(db_url, model_dir)
    with factory.stack:
        yield factory.start([worker.url], reasoning_parser="qwen3" if thinking else None,
                            health_check_interval_s=0, drift_check_every=1)


def turn(proxy: Proxy, messages: list[dict[str, Any]], stream: bool, key: str | None = None,
         base: Proxy | None = None) -> dict[str, Any]:
    """One chat call; the assistant message as an agent sends it back: tool-call ids rewritten,
    reasoning dropped."""
    client = (base or proxy).client(key or proxy.session_key)
    kwargs: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS}
    if stream:
        result = assemble_stream(client.chat.completions.create(**kwargs, stream=True))
        content, calls = result["content"], [(c["name"], c["arguments"]) for c in result["calls"]]
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        content = message.content
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    sent: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        sent["tool_calls"] = [
            {"id": f"call_client_{len(messages)}_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(json.loads(arguments), indent=1)}}
            for i, (name, arguments) in enumerate(calls)
        ]
    return sent


def tool_results(assistant: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"value": index * 10})}
            for index, call in enumerate(assistant.get("tool_calls") or [])]


def chained_prompts(rows: list[Completion]) -> list[list[int]]:
    """Each completion's full prompt, rebuilt as parent prompt + parent output + own suffix."""
    prompts: list[list[int]] = []
    for index, row in enumerate(rows):
        if index == 0:
            prompts.append(row.prompt_ids.tolist())
        else:
            prompts.append([*prompts[-1], *rows[index - 1].output_ids.tolist(), *row.prompt_ids.tolist()])
    return prompts


def five_turns(proxy: Proxy) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [SYSTEM, QUESTION]
    for index in range(LOOKUPS + 1):
        assistant = turn(proxy, messages, stream=index % 2 == 1)
        messages += [assistant, *tool_results(assistant)]
    messages.append(SUMMARIZE)
    messages.append(turn(proxy, messages, stream=True))
    return messages


def test_a_five_turn_tool_conversation_is_one_token_exact_chain(
    proxy: Proxy, worker: ScriptedWorker, script: TextScript, thinking: bool, model_dir: Path
) -> None:
    messages = five_turns(proxy)

    rows = session_completions(proxy)
    assert len(rows) == 5
    assert rows[0].parent_id is None
    assert [row.parent_id for row in rows[1:]] == [row.id for row in rows[:-1]]
    assert not any(row.branched for row in rows)
    prompts = chained_prompts(rows)
    sent = [request.body["input_ids"] for request in worker.requests_to("/generate")]
    assert sent == prompts  # the worker saw exactly parent prompt + parent output + suffix, every turn

    tokenizer = script.tokenizer
    eos = script.eos
    for row in rows:
        assert int(row.output_ids[-1]) == eos  # each output holds its end-of-turn token
    for index in range(1, LOOKUPS + 1):  # after a tool call: the end of the turn, the result, the prompt
        result = json.dumps({"value": 0})
        suffix = ("\n<|im_start|>user\n<tool_response>\n" + result + "\n</tool_response><|im_end|>\n"
                  "<|im_start|>assistant\n")
        assert rows[index].prompt_ids.tolist() == tokenizer.encode(suffix, add_special_tokens=False)
        assert rows[index].request_json["messages"] == [tool_results(messages[2 + 2 * (index - 1)])[0]]
    assert rows[4].request_json["messages"] == [SUMMARIZE]
    request = ChatCompletionRequest.model_validate({"messages": messages[:-1], "tools": TOOLS})
    fresh = load_chat_tokenizer(model_dir, None).render(request.template_messages(), request.template_tools())
    if thinking:  # a fresh render would have dropped the <think> blocks the model saw
        assert fresh != prompts[4]
        assert tokenizer.decode(prompts[4]).count("<think>") == LOOKUPS + 1
        assert metric(proxy.base_url, "flywheel_proxy_conversation_drift_total") == 4
    else:  # this template does not rewrite history: chaining changed nothing
        assert fresh == prompts[4]
        assert metric(proxy.base_url, "flywheel_proxy_conversation_drift_total") == 0
    assert metric(proxy.base_url, "flywheel_proxy_conversation_turns_total", {"kind": "chained"}) == 4

    assert run_db(proxy.db_url, lambda f: reward_end_and_finalize(f, proxy.session_id)) == 1
    [trajectory] = run_db(proxy.db_url, lambda f: session_trajectories(f, proxy.session_id))
    expected = [*prompts[4], *rows[4].output_ids.tolist()]
    assert trajectory.token_ids.tolist() == expected
    mask = np.zeros(len(expected), dtype=bool)
    outputs: list[float] = []
    for prompt, row in zip(prompts, rows, strict=True):
        mask[len(prompt): len(prompt) + len(row.output_ids)] = True
        outputs += row.output_logprobs.tolist()
    assert trajectory.loss_mask.tolist() == mask.tolist()
    assert trajectory.logprobs[mask].tolist() == outputs
    assert (trajectory.logprobs[~mask] == 0).all() and (trajectory.versions[~mask] == -1).all()
    assert trajectory.reward == 1.0


@pytest.mark.parametrize("thinking", [False], ids=["chatml"])
def test_an_edited_or_dropped_history_starts_a_flagged_branch(proxy: Proxy) -> None:
    messages: list[dict[str, Any]] = [SYSTEM, QUESTION]
    for _ in range(2):
        assistant = turn(proxy, messages, stream=False)
        messages += [assistant, *tool_results(assistant)]
    turn(proxy, [SYSTEM, QUESTION], stream=False)  # the first turn asked again: a resample, no branch
    assert metric(proxy.base_url, "flywheel_proxy_conversation_turns_total", {"kind": "branched"}) == 0

    edited = [SYSTEM, {"role": "user", "content": "Do the lookups, please."}, *messages[2:]]
    edited_answer = turn(proxy, edited, stream=False)
    dropped = [SYSTEM, QUESTION, *messages[4:]]  # the first call and its result left out
    turn(proxy, dropped, stream=True)

    rows = session_completions(proxy)
    assert [(row.parent_id is None, row.branched) for row in rows] == [
        (True, False), (False, False), (True, False), (True, True), (True, True)
    ]
    assert metric(proxy.base_url, "flywheel_proxy_conversation_turns_total", {"kind": "branched"}) == 2
    assert rows[3].request_json["messages"] == edited  # a branch root stores its whole history

    turn(proxy, [*edited, edited_answer, *tool_results(edited_answer)], stream=False)
    rows = session_completions(proxy)
    assert rows[-1].parent_id == rows[3].id and not rows[-1].branched  # the branch goes on chaining

    turn(proxy, [{"role": "user", "content": "Unrelated."}], stream=False)  # shares no history
    rows = session_completions(proxy)
    assert rows[-1].parent_id is None and not rows[-1].branched
    assert metric(proxy.base_url, "flywheel_proxy_conversation_turns_total", {"kind": "branched"}) == 2


@pytest.mark.parametrize("thinking", [False], ids=["chatml"])
def test_an_answer_sent_back_with_other_surrounding_whitespace_still_chains(proxy: Proxy) -> None:
    """Agents such as hermes-agent strip the answers they send back: still the same turn."""
    first = turn(proxy, [SYSTEM, SUMMARIZE], stream=False)
    assert first["content"] == "Three lookups."
    padded = {"role": "assistant", "content": f"  {first['content']} \n"}
    turn(proxy, [SYSTEM, SUMMARIZE, padded, SUMMARIZE], stream=False)
    rows = session_completions(proxy)
    assert rows[1].parent_id == rows[0].id and not rows[1].branched


@pytest.mark.parametrize("thinking", [False], ids=["chatml"])
def test_a_restarted_proxy_rebuilds_the_tree_from_the_database(
    proxy: Proxy, db_url: str, model_dir: Path, worker: ScriptedWorker
) -> None:
    messages: list[dict[str, Any]] = [SYSTEM, QUESTION]
    for _ in range(2):
        assistant = turn(proxy, messages, stream=False)
        messages += [assistant, *tool_results(assistant)]

    factory = ProxyFactory(db_url, model_dir)  # a fresh process: nothing in memory
    with factory.stack:
        restarted = factory.start([worker.url], health_check_interval_s=0)
        assistant = turn(proxy, messages, stream=True, base=restarted)
        messages += [assistant, *tool_results(assistant)]
        assistant = turn(proxy, messages, stream=False, base=restarted)
        messages += [assistant, *tool_results(assistant)]
        chained = metric(restarted.base_url, "flywheel_proxy_conversation_turns_total", {"kind": "chained"})
    # Back on the first proxy, whose tree lacks the turns the other one recorded: it reloads and chains.
    turn(proxy, [*messages, SUMMARIZE], stream=False)

    rows = session_completions(proxy)
    assert len(rows) == 5 and [row.parent_id for row in rows[1:]] == [row.id for row in rows[:-1]]
    assert not any(row.branched for row in rows)
    assert chained == 2
    assert metric(proxy.base_url, "flywheel_proxy_conversation_turns_total", {"kind": "chained"}) == 2
    assert [request.body["input_ids"] for request in worker.requests_to("/generate")] == chained_prompts(rows)
