"""Token-exact multi-turn conversations (DESIGN.md §3): each session's completions form a tree, and a
request whose messages extend an earlier completion is prompted with
`parent prompt + parent output + suffix` instead of a fresh render, so history is never retokenized.

The tree of a session lives in memory (an LRU of sessions per proxy) and is rebuilt from the database
when it is missing or when a request matches nothing in it (a restart, an eviction, or a completion
another proxy recorded). It learns each completion once it is recorded (`IndexingRecorder`), from the
record alone: a child's request_json holds only its new messages, and its path is its parent's path
plus those messages plus the assistant message the proxy answered.

Other endpoints (the Responses API) call `conversation_prompt` with chat-template messages and tools,
then record with the returned parent and prefix (GenerationPlan.parent_id/prefix_len/branched). Only
records whose request_json has chat `messages` are learned.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import ValidationError

from proxy.config import DEFAULT_MAX_NODES, DEFAULT_MAX_SESSIONS
from proxy.conversation_text import (
    ConversationKeys,
    MessageKey,
    SuffixError,
    is_assistant,
    message_key,
    prefix_hashes,
    render_suffix,
    tools_key,
)
from proxy.metrics import ProxyMetrics
from proxy.recorder import Recorder
from proxy.responses_api_record import responses_record_keys
from proxy.schemas import ChatCompletionRequest
from storage.engine import SessionFactory
from storage.queries import load_session_completions
from storage.records import CompletionRecord

if TYPE_CHECKING:
    from proxy.services import ProxyServices

logger = logging.getLogger(__name__)

_EVICT_SCAN = 64  # oldest nodes looked at per eviction (a long chain has no leaf among them)


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

    def full_ids(self) -> list[int]:
        """The whole sequence of this completion: every prompt suffix and output from the root."""
        parts: list[np.ndarray] = []
        node: ConversationNode | None = self
        while node is not None:
            parts += [node.output_ids, node.prompt_ids]
            node = node.parent
        return [int(t) for t in np.concatenate(parts[::-1])] if parts else []


@dataclass(eq=False)
class SessionTree:
    """A session's conversation tree, indexed by the rolling hash of each node's path."""

    max_nodes: int = DEFAULT_MAX_NODES
    nodes: dict[str, ConversationNode] = field(default_factory=dict)
    by_hash: dict[int, list[ConversationNode]] = field(default_factory=dict)
    openings: set[MessageKey] = field(default_factory=set)
    """The first message of every conversation in the session."""
    answers: set[MessageKey] = field(default_factory=set)
    """The assistant message of every completion in the session."""
    asked: set[int] = field(default_factory=set)
    """Hashes of the messages (with tools) each completion answered: a request asking them again is a
    resample, not an edit."""
    foreign: set[MessageKey] = field(default_factory=set)
    """Assistant messages clients sent that no completion of the session answered, even after a reload
    (few-shot examples, another model's turns): they never trigger a reload again."""
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
        path = (*(parent.path if parent is not None else ()), *new_keys, answer)
        node = ConversationNode(
            id=record.id, parent=parent, path=path, tools=tools,
            prompt_ids=np.asarray(record.prompt_ids, dtype=np.int32),
            output_ids=np.asarray(record.output_ids, dtype=np.int32),
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
        if parent is not None:
            parent.children += 1
        if len(self.nodes) > self.max_nodes:
            self._evict()
        return True

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

    def may_be_stale_for(self, keys: Sequence[MessageKey]) -> bool:
        """Whether `keys` hold an assistant message this tree never answered: the database may know it
        (another proxy recorded it, or this one recorded it for a caller that left before learning it)."""
        return any(self._unknown_answer(key) for key in keys)

    def note_foreign(self, keys: Sequence[MessageKey]) -> None:
        """After a reload: the assistant messages in `keys` still unknown are not ours."""
        self.foreign.update(key for key in keys if self._unknown_answer(key))

    def _unknown_answer(self, key: MessageKey) -> bool:
        return is_assistant(key) and key not in self.answers and key not in self.foreign

    def is_branch(self, tools: str | None, keys: Sequence[MessageKey]) -> bool:
        """Whether an unmatched request changed the session's history: it shares its first message with
        the session's conversations (an unrelated call, another task or a title request, starts a new root
        instead) and does not ask exactly what an earlier completion answered (a resample of a root)."""
        if not keys or keys[0] not in self.openings:
            return False
        return prefix_hashes(tools, keys)[-1] not in self.asked

    def deepest_prefix(self, tools: str | None, keys: Sequence[MessageKey]) -> ConversationNode | None:
        """The deepest completion whose messages plus its answer are a prefix of `keys`, leaving at least
        one new message; the latest such completion when several (a retried turn) tie."""
        hashes = prefix_hashes(tools, keys)
        for length in range(len(keys) - 1, 0, -1):
            for node in reversed(self.by_hash.get(hashes[length - 1], ())):
                if node.tools == tools and node.path == tuple(keys[:length]):
                    return node
        return None


def chat_record(
    record: CompletionRecord, keys: ConversationKeys | None = None
) -> tuple[list[MessageKey], str | None, MessageKey] | None:
    """The new message keys, tools key and answer key of a chat completion record (the message and
    tools keys taken from `keys` when the call passed them on); None if it is no chat completion."""
    if record.response_json.get("object") == "response":  # a Responses API call (its own record shape)
        return responses_record_keys(record)
    try:
        message = record.response_json["choices"][0]["message"]
        if keys is not None:
            return list(keys[0]), keys[1], message_key(message)
        request = ChatCompletionRequest.model_validate(record.request_json)
    except (ValidationError, KeyError, IndexError, TypeError):
        return None
    new_keys = [message_key(m) for m in request.template_messages()]
    return new_keys, tools_key(request.template_tools()), message_key(message)


class ConversationIndex:
    """The session trees of one proxy: an LRU of at most `max_sessions`, each keeping its newest
    `max_nodes` completions, refilled from the database (proxy.conversation_sessions_max/_nodes_max).
    Across the trees held, which sessions answered each assistant message: an online key's call finds
    the sessions it may extend from its assistant messages, not by trying every session it owns."""

    def __init__(
        self, session_factory: SessionFactory, max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_nodes: int = DEFAULT_MAX_NODES,
    ) -> None:
        self._session_factory = session_factory
        self._max_sessions = max_sessions
        self._max_nodes = max_nodes
        self._trees: OrderedDict[str, SessionTree] = OrderedDict()
        self._answered: dict[MessageKey, set[str]] = {}
        self._chained = 0

    def __len__(self) -> int:
        return len(self._trees)

    def drift_check_due(self, every: int) -> bool:
        """Whether this chained turn is one of the one-in-`every` compared with a fresh render."""
        self._chained += 1
        return every > 0 and self._chained % every == 0

    async def tree(self, session_id: str, *, reload: bool = False) -> tuple[SessionTree, bool]:
        """The session's tree and whether it was (re)loaded from the database just now."""
        tree = self._trees.get(session_id)
        if tree is not None and not reload:
            self._trees.move_to_end(session_id)
            return tree, False
        records = await load_session_completions(self._session_factory, session_id)
        tree = SessionTree(max_nodes=self._max_nodes)
        if not tree.add_all(records):
            logger.warning("session %s: some completions have parents outside it; not matched", session_id)
        self._forget(session_id)  # the tree it replaces, if any (a reload, or a load that raced it)
        self._trees[session_id] = tree
        for answer in tree.answers:
            self._note_answer(session_id, answer)
        tree.on_answer = lambda answer: self._note_answer(session_id, answer)
        while len(self._trees) > self._max_sessions:
            self._forget(next(iter(self._trees)))
        return tree, True

    def holds(self, session_id: str) -> bool:
        """Whether the session's tree is in memory."""
        return session_id in self._trees

    def sessions_answering(self, keys: Iterable[MessageKey]) -> set[str]:
        """The sessions held in memory whose completions answered one of the assistant messages in
        `keys`: the only ones of those held whose conversations a call with these messages can extend."""
        found: set[str] = set()
        for key in keys:
            if is_assistant(key):
                found.update(self._answered.get(key, ()))
        return found

    def _note_answer(self, session_id: str, answer: MessageKey) -> None:
        self._answered.setdefault(answer, set()).add(session_id)

    def _forget(self, session_id: str) -> None:
        """Drop a session's tree, and it from the answers index."""
        tree = self._trees.pop(session_id, None)
        if tree is None:
            return
        tree.on_answer = None
        for answer in tree.answers:
            sessions = self._answered.get(answer)
            if sessions is not None:
                sessions.discard(session_id)
                if not sessions:
                    del self._answered[answer]

    def learn(self, records: Sequence[CompletionRecord], keys: ConversationKeys | None = None) -> None:
        """Add recorded completions (of one call, if `keys` are given) to the trees of sessions held in
        memory (others load when asked)."""
        for record in records:
            tree = self._trees.get(record.session_id)
            if tree is not None and not tree.add(record, keys):
                self._forget(record.session_id)  # incomplete: rebuild from the database next time


class IndexingRecorder(Recorder):
    """The completion recorder that tells the conversation index about every completion it wrote."""

    def __init__(
        self, session_factory: SessionFactory, batch_max: int, metrics: ProxyMetrics, index: ConversationIndex
    ) -> None:
        super().__init__(session_factory, batch_max, metrics)
        self.index = index

    async def record(self, records: Sequence[CompletionRecord], keys: ConversationKeys | None = None) -> None:
        """Record, then index; `keys` (the call's conversation keys) spare parsing the request again."""
        await super().record(records)
        self.index.learn(records, keys)


@dataclass(frozen=True, slots=True)
class ConversationPrompt:
    """The prompt of one call in its session's conversation tree."""

    prompt_ids: list[int]
    parent_id: str | None = None
    prefix_len: int = 0  # leading prompt tokens that are the parent's prompt + output
    new_from: int = 0  # index of the first message not already in the parent's history
    branched: bool = False
    keys: ConversationKeys | None = None  # of messages[new_from:], for the record's indexing


async def conversation_prompt(
    services: ProxyServices, session_id: str, messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
) -> ConversationPrompt:
    """The token-exact prompt for `messages` (chat-template form) and `tools` in the session: chained
    onto the deepest earlier completion they extend, else rendered from scratch: a branch when it shares
    its first message with the session's conversations (the client edited or dropped history), a new
    root otherwise."""
    keys = [message_key(m) for m in messages]
    tools_id = tools_key(tools)
    tree, loaded = await services.conversations.tree(session_id)
    parent = tree.deepest_prefix(tools_id, keys)
    # New messages holding an assistant turn the tree never answered: maybe another proxy recorded it.
    if not loaded and tree.may_be_stale_for(keys[len(parent.path) if parent else 0:]):
        tree, loaded = await services.conversations.tree(session_id, reload=True)
        parent = tree.deepest_prefix(tools_id, keys)
    if loaded:
        tree.note_foreign(keys[len(parent.path) if parent else 0:])
    config, metrics = services.config, services.metrics
    if parent is not None:
        new_messages = list(messages[len(parent.path):])
        try:
            suffix = render_suffix(services.tokenizer, list(parent.output_ids), new_messages, tools)
        except SuffixError as exc:
            logger.warning("session %s: cannot chain onto %s (%s); rendering afresh",
                           session_id, parent.id, exc)
        else:
            prefix = parent.full_ids()
            prompt = [*prefix, *suffix]
            if services.conversations.drift_check_due(config.drift_check_every):
                services.spawn(_check_drift(services, session_id, list(messages), tools, prompt),
                               name=f"drift-check-{session_id}")
            metrics.conversation_turns.labels("chained").inc()
            return ConversationPrompt(prompt, parent.id, len(prefix), len(parent.path), False,
                                      (tuple(keys[len(parent.path):]), tools_id))
    prompt = await services.tokenizer.render_async(messages, tools, config.tokenize_in_thread_chars)
    branched = parent is None and tree.is_branch(tools_id, keys)
    metrics.conversation_turns.labels("branched" if branched else "root").inc()
    if branched:
        logger.info("session %s: history changed; a new branch starts", session_id)
    return ConversationPrompt(prompt, branched=branched, keys=(tuple(keys), tools_id))


async def _check_drift(
    services: ProxyServices, session_id: str, messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None, prompt: list[int],
) -> None:
    """Count a chained prompt that differs from a fresh render of the same messages: expected with
    history-rewriting templates, drift otherwise."""
    try:
        scratch = await services.tokenizer.render_async(
            messages, tools, services.config.tokenize_in_thread_chars
        )
    except Exception as exc:  # a task boundary: the answer does not depend on this check
        logger.warning("session %s: drift check failed: %s", session_id, exc)
        return
    if scratch != prompt:
        services.metrics.conversation_drift.inc()
        logger.debug("session %s: chained prompt differs from a fresh render", session_id)
