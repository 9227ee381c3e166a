"""Multi-turn Messages API conversations through the real proxy and the real `anthropic` client: each turn
resends the history (tool_use blocks, tool_result blocks, answers), chains token-exactly onto the turn
before (the worker sees parent prompt + parent output + suffix), and the session becomes one trajectory
once rewarded and ended through the RL API; chat and Messages turns of one session chain onto each
other."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from storage.models import Trajectory
from tests.support.anthropic_messages import (
    ANSWER,
    CHAT_TOOLS,
    QUESTION,
    THANKS,
    TOOLS,
    blocks,
    client,
    reply,
)
from tests.support.finalizing import session_trajectories
from tests.support.proxy_harness import Proxy, ProxyFactory, install_script, run_db, session_completions
from tests.support.responses_api import worker_inputs
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, worker: ScriptedWorker) -> Proxy:
    return proxies.start([worker.url])


def tool_result(message: Any) -> dict[str, Any]:
    [call] = [block for block in message.content if block.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees"}
    return {"role": "user", "content": [result]}


def trajectories_after_reward_and_end(proxy: Proxy) -> list[Trajectory]:
    """Reward and end the proxy's session through the RL API (with `x-api-key`), then wait for the proxy's
    finalizer to write its trajectories."""
    headers = {"x-api-key": proxy.session_key}
    base = f"{proxy.base_url}/rl/v1/sessions/{proxy.session_id}"
    assert httpx.post(f"{base}/reward", json={"value": 1.0}, headers=headers).status_code == 200
    assert httpx.post(f"{base}/end", headers=headers).status_code == 200
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = run_db(proxy.db_url, lambda f: session_trajectories(f, proxy.session_id))
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError("the session was not finalized")


def test_a_three_turn_conversation_is_one_token_exact_trajectory(
    proxy: Proxy, worker: ScriptedWorker, script: TextScript
) -> None:
    sdk = client(proxy)
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 128, "tools": TOOLS,
                              "system": "You check the weather."}
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = sdk.messages.create(messages=messages, **kwargs)  # type: ignore[arg-type]
    messages += [{"role": "assistant", "content": blocks(first)}, tool_result(first)]
    with sdk.messages.stream(messages=messages, **kwargs) as stream:  # type: ignore[arg-type]
        second = stream.get_final_message()
    assert blocks(second) == [{"type": "text", "text": ANSWER}]
    messages += [{"role": "assistant", "content": blocks(second)}, {"role": "user", "content": "Thanks!"}]
    third = sdk.messages.create(messages=messages, **kwargs)  # type: ignore[arg-type]
    assert blocks(third) == [{"type": "text", "text": THANKS}]

    rows = session_completions(proxy)
    assert [row.id for row in rows] == [first.id, second.id, third.id]
    assert [row.parent_id for row in rows] == [None, first.id, second.id]
    assert not any(row.branched for row in rows)
    prompts = [rows[0].prompt_ids.tolist()]
    for parent, row in itertools.pairwise(rows):
        prompts.append([*prompts[-1], *parent.output_ids.tolist(), *row.prompt_ids.tolist()])
    assert worker_inputs(worker) == prompts  # each turn's prompt extends the one before, token for token
    assert [row.request_json["messages"] for row in rows[1:]] == [messages[2:3], messages[4:5]]
    status = httpx.get(f"{proxy.base_url}/rl/v1/sessions/{proxy.session_id}",
                       headers={"x-api-key": proxy.session_key}).json()
    assert [c["id"] for c in status["completions"]] == [first.id, second.id, third.id]

    [trajectory] = trajectories_after_reward_and_end(proxy)
    expected = [*prompts[2], *rows[2].output_ids.tolist()]
    assert trajectory.token_ids.tolist() == expected
    mask = np.zeros(len(expected), dtype=bool)
    for prompt, row in zip(prompts, rows, strict=True):
        mask[len(prompt): len(prompt) + len(row.output_ids)] = True
    assert trajectory.loss_mask.tolist() == mask.tolist()
    assert trajectory.logprobs[mask].tolist() == [lp for row in rows for lp in row.output_logprobs.tolist()]
    assert trajectory.reward == 1.0


def test_chat_and_messages_turns_of_one_session_chain_onto_each_other(proxy: Proxy) -> None:
    question = {"role": "user", "content": QUESTION}
    chat = proxy.client().chat.completions.create(model="m", messages=[question], tools=CHAT_TOOLS)  # type: ignore[list-item,arg-type]
    [call] = chat.choices[0].message.tool_calls or []
    history = [question,
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_mine",
                                                  "name": call.function.name, "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_mine",
                                             "content": "21 degrees"}]}]
    message = client(proxy).messages.create(model="m", max_tokens=128, tools=TOOLS, messages=history)  # type: ignore[arg-type]
    assert blocks(message) == [{"type": "text", "text": ANSWER}]

    chat_history = [question, chat.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
                    {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Thanks!"}]
    last = proxy.client().chat.completions.create(model="m", messages=chat_history, tools=CHAT_TOOLS)  # type: ignore[arg-type]
    rows = session_completions(proxy)
    assert [(row.id, row.parent_id) for row in rows] == [
        (chat.id, None), (message.id, chat.id), (last.id, message.id)
    ]
    assert not any(row.branched for row in rows)
