"""The Hermes chat front end's pure parts (integrations/hermes/chat.py imports only the standard library
until it makes an agent), and its example config and eval set: they load as `flywheel up --online` reads
them. The chat against the real proxy, trainer and hermes-agent: tests/integration/test_hermes_online.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from flywheel.cli import main
from flywheel.config import ONLINE_OVERRIDES, load_config
from integrations.hermes.chat import (
    CONVERSATION_HEADER,
    AgentSettings,
    Command,
    describe_policy,
    error_message,
    feedback_body,
    json_object,
    parse_command,
    request_overrides,
    without_nuls,
)
from rewards.evaluation import load_eval_set

EXAMPLES = Path(__file__).resolve().parents[2] / "integrations" / "hermes"


def test_lines_are_messages_or_commands() -> None:
    assert parse_command("Hello there. /good") == Command("say", "Hello there. /good")
    assert parse_command("  /score 0.7 ") == Command("score", "0.7")
    assert parse_command("/comment  too long, but right") == Command("comment", "too long, but right")
    assert parse_command("/GOOD") == Command("good")
    assert parse_command("/frobnicate now") == Command("unknown", "frobnicate")


def test_judgements_become_feedback_bodies() -> None:
    assert feedback_body(Command("good")) == {"thumbs": "up"}
    assert feedback_body(Command("bad")) == {"thumbs": "down"}
    assert feedback_body(Command("score", "-0.25")) == {"value": -0.25}
    assert feedback_body(Command("comment", "Exactly right.")) == {"comment": "Exactly right."}
    for refused in (Command("score", "high"), Command("score", "nan"), Command("comment"), Command("new")):
        with pytest.raises(ValueError):
            feedback_body(refused)


def test_history_loses_nul_characters_and_nothing_else() -> None:
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a\x00b\x00", "reasoning": "kept"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    cleaned = without_nuls(history)
    assert cleaned == [history[0], {"role": "assistant", "content": "ab", "reasoning": "kept"}, history[2]]
    assert history[1]["content"] == "a\x00b\x00"  # the agent's own history is left alone


def test_every_call_carries_the_conversation_id_beside_the_users_overrides() -> None:
    settings = AgentSettings(
        "http://proxy/v1", "fw-online-x", "m", (), None, {"temperature": 0.5, "extra_headers": {"X-A": "1"}}
    )
    assert request_overrides(settings, "hermes-chat-1") == {
        "temperature": 0.5,
        "extra_headers": {"X-A": "1", CONVERSATION_HEADER: "hermes-chat-1"},
    }


def test_policy_and_errors_read_in_one_line() -> None:
    view = {"policy_version": 3, "newest": {"version": 4, "status": "candidate"}, "served": None}
    assert describe_policy(view) == "policy: serving v3; newest v4 (candidate)"
    assert describe_policy({"policy_version": 0, "newest": None}) == "policy: serving v0"
    assert error_message(b'{"error": {"message": "no such completion"}}') == "no such completion"
    assert error_message(b'{"detail": [{"loc": ["body", "value"]}]}') == '[{"loc": ["body", "value"]}]'
    assert error_message(b"Bad Gateway") == "Bad Gateway"
    assert json_object('{"temperature": 0.7}') == {"temperature": 0.7}
    for refused in ("[1]", "{"):
        with pytest.raises(argparse.ArgumentTypeError):
            json_object(refused)


def test_the_example_config_loads_as_online_mode_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(EXAMPLES.parents[1])  # its paths are relative to the repository root
    path = "integrations/hermes/online.example.yaml"
    assert main(["-c", path, "config", *ONLINE_OVERRIDES]) == 0
    config = load_config(path, list(ONLINE_OVERRIDES))
    assert config.trainer.promotion.enabled and config.online.eval.hook is not None
    assert config.online.eval.hook.hook == "math"
    assert config.serving.cpu.context_length is not None and config.serving.cpu.context_length >= 65536
    items = load_eval_set(str(config.online.eval.dataset))
    assert len(items) == 12 and all("answer" in item.metadata for item in items)
    lines = (EXAMPLES / "eval.example.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [item.id for item in items]
