"""The prompt render cache (proxy/tokenize.py): a repeated prompt gets the same ids without rendering
again, callers cannot corrupt it, it stays within its bounds, and clock-reading templates bypass it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.tokenize import ChatTokenizer, RenderCache
from serving.models.tiny import build_tokenizer

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


class CountingTokenizer(ChatTokenizer):
    renders = 0

    def render_text(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> str:
        self.renders += 1
        return super().render_text(messages, tools, add_generation_prompt)


def test_a_repeated_prompt_is_rendered_once_and_equals_a_fresh_render() -> None:
    chat = CountingTokenizer(build_tokenizer(seed=0), 4096)
    fresh = ChatTokenizer(build_tokenizer(seed=0), 4096)
    first = chat.render(MESSAGES, TOOLS)
    first.append(-1)  # a caller extending its prompt must not change the cached one
    again = chat.render(MESSAGES, TOOLS)
    assert again == fresh.render(MESSAGES, TOOLS) and chat.renders == 1
    assert chat.render(MESSAGES, None) == fresh.render(MESSAGES, None) and chat.renders == 2
    edited = [MESSAGES[0], {"role": "user", "content": "hi!"}]
    assert chat.render(edited, TOOLS) == fresh.render(edited, TOOLS) and chat.renders == 3


async def test_render_async_uses_the_cache_for_long_prompts_too() -> None:
    chat = CountingTokenizer(build_tokenizer(seed=0), 4096)
    messages = [{"role": "user", "content": "x " * 100}]
    threaded = await chat.render_async(messages, None, thread_above_chars=10)
    again = await chat.render_async(messages, None, thread_above_chars=10)
    assert again == threaded == chat.render(messages, None)
    assert chat.renders == 1


def test_cache_evicts_least_recently_used_within_its_bounds() -> None:
    cache = RenderCache(max_entries=2, max_cost=100)
    cache.put(b"a", [1, 2])
    cache.put(b"b", [3])
    assert cache.get(b"a") == [1, 2]  # now most recently used
    cache.put(b"c", [4])
    assert cache.get(b"b") is None and cache.get(b"a") == [1, 2] and cache.get(b"c") == [4]
    cache.put(b"big", list(range(98)))  # cost 101: never cached
    assert cache.get(b"big") is None
    cache.put(b"d", list(range(97)))  # cost 98: the least recently used goes to make room
    assert cache.get(b"d") == list(range(97)) and cache.get(b"a") is None and cache.get(b"c") == [4]


def test_a_template_reading_the_clock_is_never_cached() -> None:
    tokenizer = build_tokenizer(seed=0)
    tokenizer.chat_template = "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}"
    chat = CountingTokenizer(tokenizer, 4096)
    assert chat.render(MESSAGES, None) == chat.render(MESSAGES, None)
    assert chat.renders == 2
