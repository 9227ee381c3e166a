"""One very large (but allowed) prompt does not stall other clients: while the proxy tokenizes it, other
calls are answered (proxy/tokenize.py encodes long texts with the GIL released, and a large call is
decoded, validated, keyed and rendered in worker threads: proxy/openai/pipeline.py `CallContext`).

The test watches the proxy's tokenizer (the proxy runs in this process) to know when the large prompt's
tokenization starts and ends, so what it asserts is an order of events, never a duration."""

from __future__ import annotations

import random
import string
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from proxy.tokenize import ChatTokenizer
from tests.support.proxy_harness import ProxyFactory
from tests.support.scripted_worker import ScriptedWorker

LARGE_CHARS = 2_000_000
SMALL_CALLS = 5


def _document(chars: int) -> str:
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(5000)]
    text = " ".join(rng.choices(words, k=chars // 5))
    return text[:chars]


class TokenizerWatch:
    """Set when the proxy starts, and when it ends, encoding a text of at least `LARGE_CHARS // 2`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.started = threading.Event()
        self.finished = threading.Event()
        encode = ChatTokenizer.encode

        def watched(tokenizer: ChatTokenizer, text: str) -> list[int]:
            if len(text) < LARGE_CHARS // 2:
                return encode(tokenizer, text)
            self.started.set()
            try:
                return encode(tokenizer, text)
            finally:
                self.finished.set()

        monkeypatch.setattr(ChatTokenizer, "encode", watched)


@pytest.mark.parametrize("turn", ["first", "chained"])
def test_small_calls_are_answered_while_a_large_prompt_is_tokenized(
    proxies: ProxyFactory, scripted: ScriptedWorker, monkeypatch: pytest.MonkeyPatch, turn: str
) -> None:
    """A first turn is rendered whole; a chained one renders only its new messages (the suffix), which
    here hold the whole document."""
    proxy = proxies.start([scripted.url], context_length=1 << 23)
    agent = proxy.client()
    messages: list[dict[str, Any]] = []
    if turn == "chained":
        messages = [{"role": "user", "content": "Read the next message."}]
        answer = agent.chat.completions.create(model="m", messages=messages, max_tokens=3)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    messages.append({"role": "user", "content": _document(LARGE_CHARS)})
    watch = TokenizerWatch(monkeypatch)
    other = proxy.client(key=proxy.admin_key)
    with ThreadPoolExecutor(1) as pool:
        large = pool.submit(agent.chat.completions.create, model="m", messages=messages, max_tokens=2)
        assert watch.started.wait(120), "the large prompt was never tokenized"
        during = 0
        for i in range(SMALL_CALLS):
            small = other.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Small call {i}."}], max_tokens=2
            )
            assert small.choices[0].message.content
            during += not watch.finished.is_set()
        assert during == SMALL_CALLS, f"only {during} small calls were answered during the tokenization"
        assert not large.done()
        response = large.result(timeout=300)
    assert response.choices[0].finish_reason == "length"
    row = proxy.completion(response.id)
    assert (row.parent_id is not None) == (turn == "chained")  # a chained turn was chained, not rendered
    assert response.usage is not None and response.usage.prompt_tokens > LARGE_CHARS // 10
