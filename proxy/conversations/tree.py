"""A session's conversation tree: each recorded completion is a node whose path is the messages it
answered plus its own answer, indexed by rolling hashes of paths, so a call's messages find the deepest
earlier completion they extend (token-exact multi-turn: docs/architecture.md, "The token-exact rule").

A node is learned from its record alone: a child's request holds only its new messages, and its path is
its parent's path plus those messages plus the assistant message the proxy answered. A record whose
request is not a chat request (a Responses API call) carries a `chat_view` of itself instead.

**Ephemeral context.** Some agents append a temporary message at the end of every request (OpenClaw's
internal-context user message; others inject the time or environment state the same way) and leave it
out of their next request, which instead goes on from the answer. Such a call extends its parent *as
the agent sees its history*: the parent's messages without its trailing ephemeral ones, then its answer.
Each node is indexed by its full path and, for up to `ephemeral_max` trailing messages that may be
ephemeral (user, system or developer messages among its own new ones, leaving at least one of those),
by its path without them. A call matched that way records how many it dropped (`dropped_messages`), so
its own path, rebuilt from records alone, leaves them out too. Its prompt still chains onto the parent's
tokens, where the dropped message stays as the model saw it (docs/architecture.md, "The token-exact
rule"). A tool result, an assistant turn or the only new message of a turn is never treated as
ephemeral: an agent that rewrites those still starts a branch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from proxy.config import DEFAULT_MAX_NODES
from proxy.conversations.messages import TemplateInput
from proxy.conversations.text import ConversationKeys, extend_hash, prefix_hashes
from rewards.message_keys import MessageKey, is_assistant, message_key, tools_key
from storage.records import CompletionRecord

CHAT_VIEW = "chat_view"
RecordKeys = tuple[list[MessageKey], str | None, MessageKey]
"""(new message keys, tools key, answer key) of a recorded completion."""

_EVICT_SCAN = 64  # oldest nodes looked at per eviction (a long chain has no leaf among them)
EPHEMERAL_ROLES = frozenset({"user", "system", "developer"})
"""Roles of the messages an agent may append to one request and leave out of the next."""


@dataclass(eq=False, slots=True)
class ConversationNode:
    """One recorded chat completion: the messages it answered plus its own assistant message."""

    id: str
    parent: ConversationNode | None
    path: tuple[MessageKey, ...]
    tools: str | None
    prompt_ids: np.ndarray  # the suffix after the parent's prompt + output (all of it for a root)
    output_ids: np.ndarray
    path_hash: int = 0
    children: int = 0  # nodes in memory that extend this one
    own: int = 0  # how many of `path`'s messages (before the answer) this completion's call added
    shortened: tuple[int, ...] = ()  # hashes of its path without 1, 2, … trailing ephemeral messages

    def full_ids(self) -> list[int]:
        """The whole sequence of this completion: every prompt suffix and output from the root."""
        parts: list[np.ndarray] = []
        node: ConversationNode | None = self
        while node is not None:
            parts += [node.output_ids, node.prompt_ids]
            node = node.parent
        return [int(t) for t in np.concatenate(parts[::-1])] if parts else []

    def history(self, dropped: int) -> tuple[MessageKey, ...]:
        """The conversation an agent that left out this completion's last `dropped` messages sees: the
        path without them, ending with the answer."""
        if not dropped:
            return self.path
        return (*self.path[: len(self.path) - 1 - dropped], self.path[-1])


@dataclass(frozen=True, slots=True)
class Match:
    """The completion a call's messages extend: its first `length` messages are `node`'s history
    without `node`'s last `dropped` messages (ephemeral context the call left out)."""

    node: ConversationNode
    length: int
    dropped: int = 0


@dataclass(eq=False)
class SessionTree:
    """A session's conversation tree, indexed by the rolling hash of each node's path."""

    max_nodes: int = DEFAULT_MAX_NODES
    nodes: dict[str, ConversationNode] = field(default_factory=dict)
    by_hash: dict[int, list[ConversationNode]] = field(default_factory=dict)
    ephemeral_max: int = 1
    """Trailing messages of a completion's request a later call may leave out and still extend it."""
    by_shortened: dict[int, list[tuple[ConversationNode, int]]] = field(default_factory=dict)
    """Nodes by the hash of their path without 1, 2, … trailing ephemeral messages (with that count)."""
    openings: set[MessageKey] = field(default_factory=set)
    """The first message of every conversation in the session."""
    answers: set[MessageKey] = field(default_factory=set)
    """The assistant message of every completion in the session."""
    asked: set[int] = field(default_factory=set)
    """Hashes of the messages (with tools) each completion answered: a request asking them again is a
    resample, not an edit."""
    foreign: set[int] = field(default_factory=set)
    """Hashes of histories (with tools) ending in an assistant message a client sent that no completion of
    the session answered there, even after a reload (few-shot examples, another model's turns): they
    never trigger a reload again."""
    on_answer: Callable[[MessageKey], None] | None = field(default=None, repr=False)
    """Told of each answer new to the tree (the index of answers across sessions)."""

    def add(self, record: CompletionRecord, keys: ConversationKeys | None = None) -> bool:
        """Learn a recorded completion (`keys`: its messages' keys, if the call has them). False if its
        parent is unknown (the tree is then incomplete)."""
        if record.id in self.nodes:
            return True
        parsed = chat_record(record, keys)
        if parsed is None:
            return True  # not a chat completion: nothing to match against
        new_keys, tools, answer = parsed
        parent = self.nodes.get(record.parent_id) if record.parent_id is not None else None
        if record.parent_id is not None and parent is None:
            return False
        history = parent.history(record.dropped_messages) if parent is not None else ()
        path = (*history, *new_keys, answer)
        node = ConversationNode(
            id=record.id, parent=parent, path=path, tools=tools,
            prompt_ids=np.asarray(record.prompt_ids, dtype=np.int32),
            output_ids=np.asarray(record.output_ids, dtype=np.int32), own=len(new_keys),
        )
        self.nodes[node.id] = node
        self.openings.add(path[0])
        if answer not in self.answers:
            self.answers.add(answer)
            if self.on_answer is not None:
                self.on_answer(answer)
        hashes = prefix_hashes(tools, path)
        node.path_hash = hashes[-1]
        self.by_hash.setdefault(node.path_hash, []).append(node)
        if len(hashes) > 1:
            self.asked.add(hashes[-2])
        self._index_shortened(node, hashes)
        if parent is not None:
            parent.children += 1
        if len(self.nodes) > self.max_nodes:
            self._evict()
        return True

    def _index_shortened(self, node: ConversationNode, hashes: Sequence[int]) -> None:
        """Index `node` by its path without each possible run of trailing ephemeral messages (`hashes`:
        its path's prefix hashes, which each shortened path's hash extends by the answer)."""
        shortened = []
        last = len(node.path) - 1  # the answer's place
        for dropped in range(1, min(self.ephemeral_max, node.own - 1) + 1):
            if node.path[last - dropped][0] not in EPHEMERAL_ROLES:
                break
            shortened.append(extend_hash(hashes[last - dropped - 1], node.path[last]))
            self.by_shortened.setdefault(shortened[-1], []).append((node, dropped))
        node.shortened = tuple(shortened)

    def _evict(self) -> None:
        """Forget the oldest leaves beyond `max_nodes` (a finished conversation's last turn first). A
        later child of a forgotten node makes the tree reload from the database."""
        leaves = [n for n in itertools.islice(self.nodes.values(), _EVICT_SCAN) if n.children == 0]
        for node in leaves[: len(self.nodes) - self.max_nodes]:
            del self.nodes[node.id]
            same = self.by_hash[node.path_hash]
            same.remove(node)
            if not same:
                del self.by_hash[node.path_hash]
            for dropped, path_hash in enumerate(node.shortened, start=1):
                entries = self.by_shortened[path_hash]
                entries.remove((node, dropped))
                if not entries:
                    del self.by_shortened[path_hash]
            if node.parent is not None:
                node.parent.children -= 1

    def add_all(self, records: Sequence[CompletionRecord]) -> bool:
        """Learn records in any order (parents first where timestamps tie); False if some never fit."""
        pending = list(records)
        while pending:
            left = [record for record in pending if not self.add(record)]
            if len(left) == len(pending):
                return False
            pending = left
        return True

    def may_be_stale_for(self, keys: Sequence[MessageKey], tools: str | None = None, start: int = 0) -> bool:
        """Whether a call's messages `keys` (with `tools`) hold, from `start` on (past its deepest match),
        an assistant message that no completion of this tree answered at that place of the conversation:
        the database may know one (another proxy recorded it, this one evicted it, or recorded it for a
        caller that left before learning it). Judged by place, not by text alone: in a session whose
        answers repeat (the same tool call twice, "OK."), a turn this tree missed has a known text."""
        return bool(self._unexplained(keys, tools, start))

    def note_foreign(self, keys: Sequence[MessageKey], tools: str | None = None, start: int = 0) -> None:
        """After a reload: the assistant messages of `keys` from `start` on still unexplained are not ours."""
        self.foreign.update(self._unexplained(keys, tools, start))

    def _unexplained(self, keys: Sequence[MessageKey], tools: str | None, start: int) -> list[int]:
        """The hashes of the histories `keys[:i + 1]` (i >= `start`) that end in an assistant message no
        completion here answered after exactly that history, and that are not known to be foreign."""
        places = [i for i in range(start, len(keys)) if is_assistant(keys[i])]
        if not places:
            return []
        hashes = prefix_hashes(tools, keys)
        return [hashes[i] for i in places if hashes[i] not in self.foreign
                and not self._answered_after(tools, keys[: i + 1], hashes[i])]

    def _answered_after(self, tools: str | None, history: Sequence[MessageKey], history_hash: int) -> bool:
        """Whether a completion's conversation, as later calls see it, is `history` (its last message the
        answer): its whole path, or its path without trailing ephemeral messages."""
        path = tuple(history)
        return any(node.tools == tools and node.path == path for node in self.by_hash.get(history_hash, ())) \
            or any(node.tools == tools and node.history(dropped) == path
                   for node, dropped in self.by_shortened.get(history_hash, ()))

    def is_branch(self, tools: str | None, keys: Sequence[MessageKey]) -> bool:
        """Whether an unmatched request changed the session's history: it shares its first message with
        the session's conversations (an unrelated call, another task or a title request, starts a new root
        instead) and does not ask exactly what an earlier completion answered (a resample of a root)."""
        if not keys or keys[0] not in self.openings:
            return False
        return prefix_hashes(tools, keys)[-1] not in self.asked

    def deepest_prefix(self, tools: str | None, keys: Sequence[MessageKey]) -> Match | None:
        """The deepest completion whose messages plus its answer are a prefix of `keys`, leaving at least
        one new message; the latest such completion when several (a retried turn) tie. A completion
        matched only without its trailing ephemeral messages counts at the length matched, and loses a
        tie to one matched whole."""
        hashes = prefix_hashes(tools, keys)
        for length in range(len(keys) - 1, 0, -1):
            prefix = tuple(keys[:length])
            for node in reversed(self.by_hash.get(hashes[length - 1], ())):
                if node.tools == tools and node.path == prefix:
                    return Match(node, length)
            for node, dropped in reversed(self.by_shortened.get(hashes[length - 1], ())):
                if node.tools == tools and node.history(dropped) == prefix:
                    return Match(node, length, dropped)
        return None


def chat_view(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, answer: dict[str, Any] | None
) -> dict[str, Any]:
    """The `chat_view` entry of a recorded call whose request is not a chat request (the Responses
    API): the chat-template messages it added to its parent's history, the tools it rendered, and the
    assistant message its answer makes (None: it makes none, so nothing can extend it)."""
    return {"messages": list(messages), "tools": list(tools) if tools else None, "answer": answer}


def chat_record(record: CompletionRecord, keys: ConversationKeys | None = None) -> RecordKeys | None:
    """The new message keys, tools key and answer key of a recorded completion (the message and tools
    keys taken from `keys` when the call passed them on); None if it holds no chat conversation."""
    view = record.request_json.get(CHAT_VIEW)
    if isinstance(view, dict):
        answer = view.get("answer")
        if not isinstance(answer, dict):
            return None
        if keys is not None:
            return list(keys[0]), keys[1], message_key(answer)
        return [message_key(m) for m in view.get("messages") or ()], tools_key(view.get("tools")), \
            message_key(answer)
    try:
        message = record.response_json["choices"][0]["message"]
        if keys is not None:
            return list(keys[0]), keys[1], message_key(message)
        request = TemplateInput.model_validate(record.request_json)
    except (ValidationError, KeyError, IndexError, TypeError):
        return None
    new_keys = [message_key(m) for m in request.template_messages()]
    return new_keys, tools_key(request.template_tools()), message_key(message)
