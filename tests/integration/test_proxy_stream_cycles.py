"""A streamed call leaves no reference cycle behind: once its streams are recorded, its body and streams
are freed by reference counting. A cycle (the body listing its streams, each stream pointing back at
the body) would keep every call's request, results and records alive until the garbage collector's next
pass, and make that collector run and traverse far more often under load."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.openai.streaming import GenerationStream, StreamBody
from tests.support.proxy_harness import Proxy

pytestmark = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)

MESSAGES: Any = [{"role": "user", "content": "Hi"}]
_FREED_WITHIN_S = 2.0


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic garbage collector off: what is freed meanwhile is freed by reference counting."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _stream_objects() -> list[object]:
    return [o for o in gc.get_objects() if isinstance(o, StreamBody | GenerationStream)]


def _left_in_cycles() -> list[object]:
    """The stream objects still alive once the calls' tasks had time to end, which then only the
    collector frees (found in gc.garbage with DEBUG_SAVEALL)."""
    deadline = time.monotonic() + _FREED_WITHIN_S
    while _stream_objects() and time.monotonic() < deadline:
        time.sleep(0.02)  # the stream's task records and ends just after the client read the end
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, StreamBody | GenerationStream)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.usefixtures("no_collector")
def test_streamed_calls_are_freed_without_the_garbage_collector(proxy: Proxy) -> None:
    client = proxy.client()
    chat = list(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, stream=True))
    assert chat[-1].choices[0].finish_reason == "length"
    # Two prompts: one body fed by two streams.
    legacy = list(client.completions.create(model="m", prompt=["a", "b"], max_tokens=2, stream=True))
    assert {c.choices[0].index for c in legacy if c.choices} == {0, 1}
    assert _left_in_cycles() == []
