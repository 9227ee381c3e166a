"""The prompt of one call in its session's conversation: chained token-exactly onto the deepest earlier
completion its messages extend (`parent prompt + parent output + suffix`, so history is never
retokenized), else rendered afresh as a new root or, when the client changed the session's history, as
a flagged branch (docs/architecture.md, "The token-exact rule")."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.conversations.index import ConversationIndex
from proxy.conversations.text import ConversationKeys, SuffixError, render_suffix
from proxy.conversations.tree import Match
from proxy.metrics import ProxyMetrics
from proxy.tokenize import ChatTokenizer, template_chars
from rewards.message_keys import MessageKey, message_key, tools_key

logger = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]
"""Runs a coroutine in the background under a name (the app's task set, drained at shutdown)."""


@dataclass(frozen=True, slots=True)
class ConversationPrompt:
    """The prompt of one call in its session's conversation tree."""

    prompt_ids: list[int]
    parent_id: str | None = None
    """The completion this call's conversation extends; None for a root."""
    prefix_len: int = 0
    """How many leading `prompt_ids` are the parent's prompt + output: records keep only the rest."""
    new_from: int = 0
    """Index of the first message not already in the parent's history."""
    branched: bool = False
    """The client changed its session's history, so this call starts a new branch."""
    dropped: int = 0
    """Trailing messages of the parent's request this call left out (ephemeral context)."""
    keys: ConversationKeys | None = None
    """Keys of messages[new_from:] and the tools, for the record's indexing (None: parsed from it)."""


class Prompter:
    """Builds each call's prompt from its session's tree in `index`; one chained turn in
    `drift_check_every` is compared in the background with a fresh render (the drift metric)."""

    def __init__(
        self, index: ConversationIndex, tokenizer: ChatTokenizer, metrics: ProxyMetrics, spawn: Spawn,
        tokenize_in_thread_chars: int, drift_check_every: int,
    ) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self._metrics = metrics
        self._spawn = spawn
        self._thread_chars = tokenize_in_thread_chars
        self._drift_check_every = drift_check_every

    async def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        *, in_thread: bool = False,
    ) -> ConversationPrompt:
        """The prompt of a call with no history to chain onto (a one-off session); `in_thread`: a large
        call's, rendered in a worker thread whatever its length (cache look-up included)."""
        return ConversationPrompt(await self._render(messages, tools, in_thread))

    async def _render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, in_thread: bool
    ) -> list[int]:
        if in_thread:
            return await asyncio.to_thread(self.tokenizer.render, messages, tools)
        return await self.tokenizer.render_async(messages, tools, self._thread_chars)

    async def prompt(
        self, session_id: str, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        *, new: bool = False, in_thread: bool = False,
    ) -> ConversationPrompt:
        """The token-exact prompt for `messages` (chat-template form) and `tools` in the session (`new`:
        one being created for this call): chained onto the deepest earlier completion they extend, else
        rendered from scratch: a branch when it shares its first message with the session's
        conversations (the client edited or dropped history), a new root otherwise. `in_thread`: a large
        call's, whose message keys and render (or suffix) are made in worker threads."""
        if in_thread:
            keys, tools_id = await asyncio.to_thread(_keys, messages, tools)
        else:
            keys, tools_id = _keys(messages, tools)
        tree, match = await self.index.match(session_id, tools_id, keys, new=new)
        if match is not None:
            chained = await self._chain(session_id, match, messages, tools, in_thread)
            if chained is not None:
                return ConversationPrompt(chained[0], match.node.id, chained[1], match.length,
                                          keys=(tuple(keys[match.length:]), tools_id), dropped=match.dropped)
        prompt = await self._render(messages, tools, in_thread)
        branched = match is None and tree.is_branch(tools_id, keys)
        self._metrics.conversation_turns.labels("branched" if branched else "root").inc()
        if branched:
            logger.info("session %s: history changed; a new branch starts", session_id)
        return ConversationPrompt(prompt, branched=branched, keys=(tuple(keys), tools_id))

    async def _chain(
        self, session_id: str, match: Match, messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None, in_thread: bool,
    ) -> tuple[list[int], int] | None:
        """The chained prompt (`match.node`'s whole sequence, then the suffix of the new messages) and the
        length of its prefix; None if the template cannot render the suffix as a continuation."""
        parent = match.node
        new_messages = list(messages[match.length:])
        output_ids = list(parent.output_ids)
        try:
            if in_thread or template_chars(new_messages, tools) > self._thread_chars:
                suffix = await asyncio.to_thread(render_suffix, self.tokenizer, output_ids, new_messages,
                                                 tools)
            else:
                suffix = render_suffix(self.tokenizer, output_ids, new_messages, tools)
        except SuffixError as exc:
            logger.warning("session %s: cannot chain onto %s (%s); rendering afresh", session_id, parent.id,
                           exc)
            return None
        prefix = parent.full_ids()
        prompt = [*prefix, *suffix]
        # A call that left out ephemeral context differs from a fresh render by design: nothing to check.
        if not match.dropped and self.index.drift_check_due(self._drift_check_every):
            self._spawn(self._check_drift(session_id, list(messages), tools, prompt),
                        f"drift-check-{session_id}")
        self._metrics.conversation_turns.labels("ephemeral" if match.dropped else "chained").inc()
        return prompt, len(prefix)

    async def _check_drift(
        self, session_id: str, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        prompt: list[int],
    ) -> None:
        """Count a chained prompt that differs from a fresh render of the same messages: expected with
        history-rewriting templates, drift otherwise."""
        try:
            scratch = await self.tokenizer.render_async(messages, tools, self._thread_chars)
        except Exception as exc:  # a task boundary: the answer does not depend on this check
            logger.warning("session %s: drift check failed: %s", session_id, exc)
            return
        if scratch != prompt:
            self._metrics.conversation_drift.inc()
            logger.debug("session %s: chained prompt differs from a fresh render", session_id)


def _keys(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> tuple[list[MessageKey], str | None]:
    """The matching keys of a call's messages and of its tools."""
    return [message_key(m) for m in messages], tools_key(tools)
