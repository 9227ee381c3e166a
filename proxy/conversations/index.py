"""The conversation trees of one proxy (an LRU of sessions, refilled from the database) and, across the
trees held, which sessions answered each assistant message."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from proxy.config import DEFAULT_MAX_NODES, DEFAULT_MAX_SESSIONS
from proxy.conversations.text import ConversationKeys
from proxy.conversations.tree import Match, SessionTree
from proxy.privacy import is_redacted
from rewards.message_keys import MessageKey, is_assistant
from storage.engine import SessionFactory
from storage.queries import load_session_completions
from storage.records import CompletionRecord

logger = logging.getLogger(__name__)


class ConversationIndex:
    """The session trees of one proxy: an LRU of at most `max_sessions`, each keeping its newest
    `max_nodes` completions, refilled from the database (proxy.conversation_sessions_max/_nodes_max).
    Across the trees held, which sessions answered each assistant message: an online key's call finds
    the sessions it may extend from its assistant messages, not by trying every session it owns."""

    def __init__(
        self, session_factory: SessionFactory, max_sessions: int = DEFAULT_MAX_SESSIONS,
        max_nodes: int = DEFAULT_MAX_NODES, ephemeral_max: int = 1,
    ) -> None:
        self._session_factory = session_factory
        self._max_sessions = max_sessions
        self._max_nodes = max_nodes
        self._ephemeral_max = ephemeral_max
        self._trees: OrderedDict[str, SessionTree] = OrderedDict()
        self._answered: dict[MessageKey, set[str]] = {}
        self._chained = 0

    def __len__(self) -> int:
        return len(self._trees)

    def drift_check_due(self, every: int) -> bool:
        """Whether this chained turn is one of the one-in-`every` compared with a fresh render."""
        self._chained += 1
        return every > 0 and self._chained % every == 0

    async def tree(
        self, session_id: str, *, reload: bool = False, new: bool = False
    ) -> tuple[SessionTree, bool]:
        """The session's tree and whether it was (re)loaded from the database just now. A `new` session
        (being created for this call) has no completions yet: its empty tree is not loaded."""
        tree = self._trees.get(session_id)
        if tree is not None and not reload:
            self._trees.move_to_end(session_id)
            return tree, False
        records = [] if new else chainable(await load_session_completions(self._session_factory, session_id))
        tree = SessionTree(max_nodes=self._max_nodes, ephemeral_max=self._ephemeral_max)
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

    async def match(
        self, session_id: str, tools_id: str | None, keys: Sequence[MessageKey], *, new: bool = False,
        note_foreign: bool = True,
    ) -> tuple[SessionTree, Match | None]:
        """The session's tree and the deepest of its completions that a call's message `keys` (with
        `tools_id`) extend. The tree held here may lack completions another proxy recorded since it was
        loaded (or that it evicted): when the call holds an assistant message that no completion of the
        tree answered at its place past the match, the tree is reloaded from the database first, never
        deciding "no parent" or "a shallower parent" from memory alone. `note_foreign`: remember the
        assistant messages a reload did not explain either, so they never cause a reload again (for the
        session's own calls; not when trying the sessions a call might belong to)."""
        tree, loaded = await self.tree(session_id, new=new)
        match = tree.deepest_prefix(tools_id, keys)
        if not loaded and tree.may_be_stale_for(keys, tools_id, matched_length(match)):
            tree, loaded = await self.tree(session_id, reload=True)
            match = tree.deepest_prefix(tools_id, keys)
        if loaded and note_foreign:
            tree.note_foreign(keys, tools_id, matched_length(match))
        return tree, match

    def holds(self, session_id: str) -> bool:
        """Whether the session's tree is in memory."""
        return session_id in self._trees

    def holds_completions(self, session_id: str) -> bool:
        """Whether the session's tree is in memory with a completion in it. An empty one may have been
        loaded before another proxy recorded the session's first completion: only the database can tell."""
        tree = self._trees.get(session_id)
        return tree is not None and bool(tree.nodes)

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


def matched_length(match: Match | None) -> int:
    """How many of a call's messages its match covers (0 without one): the rest are new."""
    return 0 if match is None else match.length


def chainable(records: Sequence[CompletionRecord]) -> list[CompletionRecord]:
    """The stored completions a reloaded tree may chain onto: not those whose JSON was redacted
    (proxy.privacy), nor their descendants. Their stored messages are not what the model saw, so a call
    extending them is rendered afresh rather than matched against placeholders."""
    unusable: set[str] = set()
    for record in records:  # call order: parents first
        if record.parent_id in unusable or is_redacted(record.request_json):
            unusable.add(record.id)
    while True:  # a child stored in the same instant as its parent may come first
        more = {r.id for r in records if r.parent_id in unusable and r.id not in unusable}
        if not more:
            return [record for record in records if record.id not in unusable]
        unusable |= more
