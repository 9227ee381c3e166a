"""Pure pieces of token-exact multi-turn conversations (docs/architecture.md, "The token-exact rule"): what
makes two messages "the same" for prefix matching, and the tokens the chat template adds after a parent
completion's output.

What makes two messages the same (their keys) is rewards/message_keys.py: the retry-orphan check
compares messages the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rewards.message_keys import MessageKey

ConversationKeys = tuple[tuple[MessageKey, ...], str | None]
"""The keys of the messages a call's record stores and its tools key, as the call computed them: the
conversation index takes them instead of validating the recorded request again."""

# Stand-ins that no real conversation contains: the suffix is read off a render that follows them.
_DUMMY_USER = "\u2063flywheel-dummy-user\u2063"
_DUMMY_ASSISTANT = "\u2063flywheel-dummy-assistant\u2063"


class SuffixError(ValueError):
    """The chat template does not render the new messages as a plain continuation of a history."""


class TemplateRenderer(Protocol):
    """What suffix rendering needs of proxy.tokenize.ChatTokenizer."""

    def render_text(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> str: ...

    def encode(self, text: str) -> list[int]: ...


def prefix_hashes(tools: str | None, keys: Sequence[MessageKey]) -> list[int]:
    """Rolling hashes: element k-1 stands for the first k messages (with the tools)."""
    hashes: list[int] = []
    running = hash(("tools", tools))
    for key in keys:
        running = extend_hash(running, key)
        hashes.append(running)
    return hashes


def extend_hash(running: int, key: MessageKey) -> int:
    """The rolling hash of some messages followed by one more (`running`: theirs, from `prefix_hashes`)."""
    return hash((running, key))


def closed_length(output_ids: Sequence[int], close_ids: Sequence[int]) -> int:
    """How many leading tokens of the template's end-of-turn `close_ids` the output already ends with
    (an output that stopped on the end-of-turn token holds it; one cut off by length holds none)."""
    for count in range(min(len(close_ids), len(output_ids)), 0, -1):
        if list(output_ids[len(output_ids) - count:]) == list(close_ids[:count]):
            return count
    return 0


def render_suffix(
    renderer: TemplateRenderer, parent_output_ids: Sequence[int], new_messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
) -> list[int]:
    """The tokens that follow a parent's prompt + output: the rest of its assistant turn's end, the new
    messages, and the generation prompt. The new messages are rendered after a fixed dummy exchange, not
    after the real history, so a template that rewrites earlier turns (Qwen3 drops old `<think>` blocks)
    cannot change tokens the model already saw."""
    dummy = [{"role": "user", "content": _DUMMY_USER}, {"role": "assistant", "content": _DUMMY_ASSISTANT}]
    closed = renderer.render_text(dummy, tools, add_generation_prompt=False)
    extended = renderer.render_text([*dummy, *new_messages], tools, add_generation_prompt=True)
    if _DUMMY_ASSISTANT not in closed or _DUMMY_ASSISTANT not in extended:
        raise SuffixError("the chat template does not render assistant content verbatim")
    close = closed[closed.rindex(_DUMMY_ASSISTANT) + len(_DUMMY_ASSISTANT):]
    after = extended[extended.rindex(_DUMMY_ASSISTANT) + len(_DUMMY_ASSISTANT):]
    if not after.startswith(close):
        raise SuffixError(f"the assistant turn ends as {close!r} alone but as {after[:len(close)]!r} here")
    close_ids = renderer.encode(close)
    done = closed_length(parent_output_ids, close_ids)
    return [*close_ids[done:], *renderer.encode(after[len(close):])]
