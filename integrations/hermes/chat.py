"""A terminal chat with Hermes Agent through a Flywheel proxy on an online key; what you say about its
answers becomes training reward.

Run it with the python of a venv that has hermes-agent 0.19.0 (`make agents` builds .venv-agents/hermes),
never with Flywheel's own: it imports only the standard library and hermes-agent.

    .venv-agents/hermes/bin/python integrations/hermes/chat.py --base-url http://127.0.0.1:8000 \\
        --api-key "$(cat flywheel-run/online_key)"

Type a message to talk. After a turn, judge it: /good, /bad, /score X, /comment TEXT. /new starts a new
conversation, /policy shows the policy version being served, /help lists the commands, /quit (or the end
of the input) ends. It reads its input line by line, so a script can drive it through stdin.

Each conversation is one `AIAgent` whose calls carry the header `X-Flywheel-Conversation` with an id of
its own, so the proxy records the whole conversation in one session of the online key. hermes-agent does
not expose the id of the completion a turn produced, so a turn's first feedback names none: it lands on
the key's newest completion (the turn's final answer, as long as nothing else chats on the same key
meanwhile), and the feedback's answer names that completion, which later feedback on the same turn names
explicitly. /new and /quit end the conversation's session once a feedback has said which it is; else the
proxy ends it `proxy.finalizer.session_ttl_s` after its last call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

KEY_ENV = "FLYWHEEL_ONLINE_KEY"
CONVERSATION_HEADER = "X-Flywheel-Conversation"
HTTP_TIMEOUT_S = 60.0
JUDGEMENTS = frozenset({"good", "bad", "score", "comment"})
COMMANDS = frozenset({*JUDGEMENTS, "new", "policy", "help", "quit"})
HELP = """commands (after a turn):
  /good             thumbs up on the last answer
  /bad              thumbs down on the last answer
  /score X          a reward of X (a number, e.g. 0.7) for the last answer
  /comment TEXT     say what you thought of the last answer
  /new              start a new conversation
  /policy           show the policy version being served
  /quit             end (so does the end of the input)
anything else is a message to the agent"""


@dataclass(frozen=True, slots=True)
class Command:
    """One input line: `name` is a command (without its slash) or "say" (a message) or "unknown"."""

    name: str
    arg: str = ""


def parse_command(line: str) -> Command:
    text = line.strip()
    if not text.startswith("/"):
        return Command("say", text)
    word, _, rest = text[1:].partition(" ")
    name = word.lower()
    return Command(name, rest.strip()) if name in COMMANDS else Command("unknown", word)


def feedback_body(command: Command) -> dict[str, Any]:
    """The `POST /rl/v1/feedback` body of a judgement (ValueError when its argument is unusable)."""
    if command.name == "good":
        return {"thumbs": "up"}
    if command.name == "bad":
        return {"thumbs": "down"}
    if command.name == "score":
        try:
            value = float(command.arg)
        except ValueError:
            raise ValueError(f"/score needs a number, not {command.arg!r}") from None
        if not math.isfinite(value):
            raise ValueError("/score needs a finite number")
        return {"value": value}
    if command.name == "comment":
        if not command.arg:
            raise ValueError("/comment needs some text")
        return {"comment": command.arg}
    raise ValueError(f"/{command.name} is not a judgement")


def describe_policy(view: dict[str, Any]) -> str:
    """`GET /rl/v1/policy` in one line: the served version and the newest one with its status."""
    text = f"policy: serving v{view.get('policy_version')}"
    newest = view.get("newest")
    if isinstance(newest, dict):
        text += f"; newest v{newest.get('version')} ({newest.get('status')})"
    return text


def without_nuls(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history to send back, its text without NUL characters: a model may write them, but no JSON
    body may carry one to the proxy (it refuses them, since its database cannot store them)."""
    cleaned = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and "\x00" in content:
            message = {**message, "content": content.replace("\x00", "")}
        cleaned.append(message)
    return cleaned


class ProxyError(RuntimeError):
    """A call to the proxy failed: nothing answered, or it answered with an error (the message says it)."""


class FlywheelClient:
    """The few routes the chat calls besides inference, over urllib with the online key."""

    def __init__(self, root_url: str, api_key: str) -> None:
        self.root_url = root_url
        self._api_key = api_key

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.root_url}{path}", data=data, method=method)
        request.add_header("Authorization", f"Bearer {self._api_key}")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise ProxyError(f"{method} {path}: {exc.code} {error_message(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ProxyError(f"{method} {path}: no answer from {self.root_url} ({exc})") from None

    def models(self) -> list[str]:
        return [model["id"] for model in self._call("GET", "/v1/models")["data"]]

    def policy(self) -> dict[str, Any]:
        view: dict[str, Any] = self._call("GET", "/rl/v1/policy")
        return view

    def feedback(self, body: dict[str, Any]) -> dict[str, Any]:
        answer: dict[str, Any] = self._call("POST", "/rl/v1/feedback", body)
        return answer

    def end_session(self, session_id: str) -> None:
        self._call("POST", f"/rl/v1/sessions/{session_id}/end")


def error_message(raw: bytes) -> str:
    """The message of an error answer: OpenAI's `{"error": {"message"}}`, FastAPI's `detail`, else text."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "detail" in body:
            return json.dumps(body["detail"])[:500]
    return json.dumps(body)[:500]


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """What every conversation's `AIAgent` is built with."""

    v1_url: str
    api_key: str
    model: str
    toolsets: tuple[str, ...]
    max_tokens: int | None
    request_overrides: dict[str, Any] = field(default_factory=dict)
    """Merged into every chat call hermes-agent makes (its `request_overrides`: sampling fields such as
    `temperature`, `extra_body`, `extra_headers`)."""


def request_overrides(settings: AgentSettings, conversation_id: str) -> dict[str, Any]:
    """The settings' request overrides, with the conversation's id among the headers of every call."""
    headers = {**settings.request_overrides.get("extra_headers", {}), CONVERSATION_HEADER: conversation_id}
    return {**settings.request_overrides, "extra_headers": headers}


def new_agent(settings: AgentSettings, conversation_id: str) -> Any:
    """A hermes-agent `AIAgent` on the proxy: memory, context files, trajectories and checkpoints off, only
    the given toolsets, every call tagged with the conversation's id."""
    from run_agent import AIAgent  # hermes-agent's top-level module

    return AIAgent(
        base_url=settings.v1_url,
        api_key=settings.api_key,
        model=settings.model,
        enabled_toolsets=list(settings.toolsets),
        max_tokens=settings.max_tokens,
        tool_delay=0.0,
        quiet_mode=True,
        skip_memory=True,
        skip_context_files=True,
        save_trajectories=False,
        checkpoints_enabled=False,
        request_overrides=request_overrides(settings, conversation_id),
    )


@dataclass
class Conversation:
    """One conversation: its agent (made at the first message), its history, and what feedback told."""

    settings: AgentSettings
    id: str = field(default_factory=lambda: f"hermes-chat-{uuid.uuid4().hex}")
    history: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    completion_id: str | None = None  # the last turn's completion, once a feedback named it
    session_id: str | None = None  # the proxy's session, once a feedback named it
    _agent: Any = None

    def say(self, message: str) -> tuple[str, str | None]:
        """One turn: (the agent's answer, an error if the turn failed)."""
        if self._agent is None:
            self._agent = new_agent(self.settings, self.id)
        result = self._agent.run_conversation(message, conversation_history=without_nuls(self.history))
        self.history = list(result.get("messages") or self.history)
        self.turns += 1
        self.completion_id = None
        answer = (result.get("final_response") or "").replace("\x00", "")
        return answer, (str(result.get("error")) if result.get("failed") else None)


class Chat:
    """Reads commands and messages, talks to the agent, sends feedback, prints what happened."""

    def __init__(self, client: FlywheelClient, settings: AgentSettings, out: TextIO) -> None:
        self._client = client
        self._settings = settings
        self._out = out
        self.conversation = Conversation(settings)

    def _print(self, text: str) -> None:
        print(text, file=self._out, flush=True)

    def handle(self, command: Command) -> bool:
        """Carry out one command; False once the chat should end."""
        if command.name == "say":
            if command.arg:
                self._turn(command.arg)
        elif command.name in JUDGEMENTS:
            self._judge(command)
        elif command.name == "new":
            self._end_conversation()
            self.conversation = Conversation(self._settings)
            self._print("[flywheel] a new conversation")
        elif command.name == "policy":
            self._show_policy()
        elif command.name == "help":
            self._print(HELP)
        elif command.name == "quit":
            self._end_conversation()
            return False
        else:
            self._print(f"[flywheel] unknown command /{command.arg} (/help lists them)")
        return True

    def _turn(self, message: str) -> None:
        answer, error = self.conversation.say(message)
        self._print(f"hermes> {answer}")
        if error:
            self._print(f"[flywheel] the turn failed: {error}")
        self._show_policy()

    def _judge(self, command: Command) -> None:
        if not self.conversation.turns:
            self._print("[flywheel] nothing to judge yet: say something first")
            return
        try:
            body = feedback_body(command)
        except ValueError as exc:
            self._print(f"[flywheel] {exc}")
            return
        if self.conversation.completion_id is not None:
            body["completion_id"] = self.conversation.completion_id
        try:
            answer = self._client.feedback(body)
        except ProxyError as exc:
            self._print(f"[flywheel] feedback refused: {exc}")
            return
        self.conversation.completion_id = answer["completion_id"]
        self.conversation.session_id = answer["session_id"]
        self._print(
            f"[flywheel] feedback {answer['state']} on {answer['completion_id']} "
            f"(session {answer['session_id']})"
        )

    def _show_policy(self) -> None:
        try:
            self._print(f"[flywheel] {describe_policy(self._client.policy())}")
        except ProxyError as exc:
            self._print(f"[flywheel] {exc}")

    def _end_conversation(self) -> None:
        session_id = self.conversation.session_id
        if session_id is None:
            return
        try:
            self._client.end_session(session_id)
        except ProxyError as exc:
            self._print(f"[flywheel] could not end session {session_id}: {exc}")
            return
        self._print(f"[flywheel] session {session_id} ended")


def read_lines(stream: TextIO, interactive: bool) -> Iterator[str]:
    """Input lines without their newline, prompting when a person types them."""
    while True:
        if interactive:
            try:
                line = input("you> ")
            except EOFError:
                return
        else:
            line = stream.readline()
            if not line:
                return
        yield line.rstrip("\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="the proxy's root (or its /v1) URL")
    add(
        "--api-key",
        default=os.environ.get(KEY_ENV),
        help=f"an online key (default: ${KEY_ENV}); `flywheel up --online` writes one to "
        "<run dir>/online_key",
    )
    add("--model", help="the model name to call; default: the first the proxy lists at /v1/models")
    add(
        "--toolsets",
        default="",
        help="comma-separated hermes-agent toolsets the agent may use, e.g. todo; default: none",
    )
    add("--max-tokens", type=int, default=None, help="longest answer per call; default: the proxy's")
    add(
        "--request-overrides",
        type=json_object,
        default={},
        help="a JSON object merged into every chat call, e.g. '{\"temperature\": 0.7}'",
    )
    return parser


def json_object(text: str) -> dict[str, Any]:
    """An argument that must be a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.api_key:
        parser.error(f"an online key is needed: --api-key or ${KEY_ENV}")
    root = args.base_url.rstrip("/").removesuffix("/v1")
    client = FlywheelClient(root, args.api_key)
    try:
        model = args.model or client.models()[0]
    except (ProxyError, IndexError) as exc:
        print(f"[flywheel] cannot list the proxy's models: {exc}", file=sys.stderr)
        return 1
    toolsets = tuple(name.strip() for name in args.toolsets.split(",") if name.strip())
    settings = AgentSettings(
        f"{root}/v1", args.api_key, model, toolsets, args.max_tokens, args.request_overrides
    )
    chat = Chat(client, settings, sys.stdout)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {model} through {root}. /help lists the commands.", flush=True)
    for line in read_lines(sys.stdin, interactive):
        if not chat.handle(parse_command(line)):
            break
    else:
        chat.handle(Command("quit"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
