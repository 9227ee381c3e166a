"""Chaining after an n > 1 call, through the real proxy and the real `openai` client: each choice is its own
completion (`<id>` and `<id>-1`), and a conversation continued from either choice chains onto that choice's
completion token-exactly (the worker sees that choice's prompt + output + the rendered suffix); the
finalizer exports one trajectory per continued choice, each training only its generated tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

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
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript

PICK = [{"role": "system", "content": "You pick."}, {"role": "user", "content": "Pick one."}]
WHY = {"role": "user", "content": "Why?"}


def reply(prompt: str, index: int) -> str:
    if prompt.rstrip().endswith("Why?<|im_end|>\n<|im_start|>assistant"):
        return "Because." if "Choice 1." in prompt else "No reason."
    return f"Choice {index}."


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch, per_sample=True)


@pytest.fixture(name="proxy")
def proxy_fixture(db_url: str, tiny_model_dir: Path, worker: ScriptedWorker) -> Iterator[Proxy]:
    factory = ProxyFactory(db_url, tiny_model_dir)
    with factory.stack:
        yield factory.start([worker.url], health_check_interval_s=0)


def continued(proxy: Proxy, choice: str, stream: bool) -> str:
    """The second turn after the agent kept `choice`; the answer's text."""
    client = proxy.client(proxy.session_key)
    messages: list[dict[str, Any]] = [*PICK, {"role": "assistant", "content": choice}, WHY]
    if stream:
        return str(assemble_stream(client.chat.completions.create(model="m", messages=messages,
                                                                  stream=True))["content"])
    return str(client.chat.completions.create(model="m", messages=messages).choices[0].message.content)


def test_a_conversation_continued_from_either_choice_chains_onto_that_choice(
    proxy: Proxy, worker: ScriptedWorker
) -> None:
    first = proxy.client(proxy.session_key).chat.completions.create(model="m", messages=PICK, n=2)
    assert [c.message.content for c in first.choices] == ["Choice 0.", "Choice 1."]

    assert continued(proxy, "Choice 1.", stream=False) == "Because."
    assert continued(proxy, "Choice 0.", stream=True) == "No reason."

    rows = {row.id: row for row in session_completions(proxy)}
    assert set(rows) >= {first.id, f"{first.id}-1"}
    [after_one] = [row for row in rows.values() if row.parent_id == f"{first.id}-1"]
    [after_zero] = [row for row in rows.values() if row.parent_id == first.id]
    assert len(rows) == 4 and not any(row.branched for row in rows.values())
    assert metric(proxy.base_url, "flywheel_proxy_conversation_turns_total", {"kind": "chained"}) == 2

    # The worker saw each choice's own prompt + output, then the suffix that continues it.
    sent = [request.body["input_ids"] for request in worker.requests_to("/generate")]
    prompt = rows[first.id].prompt_ids.tolist()
    expected = {}
    for parent_id, child in ((f"{first.id}-1", after_one), (first.id, after_zero)):
        expected[child.id] = [*prompt, *rows[parent_id].output_ids.tolist(), *child.prompt_ids.tolist()]
    assert sent == [prompt, expected[after_one.id], expected[after_zero.id]]
    assert after_one.request_json["messages"] == [WHY]  # a child stores only its new messages

    assert run_db(proxy.db_url, lambda f: reward_end_and_finalize(f, proxy.session_id)) == 2
    trajectories = run_db(proxy.db_url, lambda f: session_trajectories(f, proxy.session_id))
    by_tokens = {tuple(t.token_ids.tolist()): t for t in trajectories}
    for parent_id, child in ((f"{first.id}-1", after_one), (first.id, after_zero)):
        tokens = [*expected[child.id], *child.output_ids.tolist()]
        trajectory = by_tokens[tuple(tokens)]
        parent = rows[parent_id]
        mask = np.zeros(len(tokens), dtype=bool)
        mask[len(prompt): len(prompt) + len(parent.output_ids)] = True
        mask[len(expected[child.id]):] = True
        assert trajectory.loss_mask.tolist() == mask.tolist()
        logprobs = [*parent.output_logprobs.tolist(), *child.output_logprobs.tolist()]
        assert trajectory.logprobs[mask].tolist() == logprobs
