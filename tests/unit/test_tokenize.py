"""ChatTokenizer (proxy/tokenize.py): token bytes exact for byte-level BPE, and roles the chat template
lacks. Its render cache is tested in test_proxy_render_cache.py."""

from __future__ import annotations

import threading

import pytest

from proxy.errors import OpenAIError
from proxy.tokenize import ChatTokenizer
from serving.models.tiny import build_tokenizer


def test_token_bytes_are_exact_for_byte_level_bpe(chat_tokenizer: ChatTokenizer) -> None:
    text = "héllo wörld 日本 <tool_call> ok"
    ids = chat_tokenizer.encode(text)
    assert b"".join(chat_tokenizer.token_bytes(i) for i in ids).decode() == text
    assert chat_tokenizer.token_bytes(2) == b"<|im_end|>"


def test_developer_role_renders_as_system_where_the_template_lacks_it() -> None:
    tokenizer = build_tokenizer(seed=0)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role not in ('system', 'user', 'assistant') %}"
        "{{ raise_exception('unknown role ' + m.role) }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    )
    chat = ChatTokenizer(tokenizer, 64)
    ids = chat.render([{"role": "developer", "content": "be brief"}], None)
    assert chat.decode(ids) == "<system>be brief"
    with pytest.raises(OpenAIError) as error:
        chat.render([{"role": "tool", "content": "x"}], None)
    assert error.value.status == 400 and "unknown role tool" in error.value.message


def test_a_long_text_is_encoded_with_the_gil_released(chat_tokenizer: ChatTokenizer) -> None:
    """`tokenizers` holds the GIL through `encode` and releases it in `encode_batch`: a long prompt
    encoded in a worker thread must leave other threads (the event loop's) running, and give exactly
    the ids `encode` gives."""
    text = " ".join(f"word{i} <|im_end|> héllo 日本" for i in range(40_000))
    backend = chat_tokenizer.tokenizer.backend_tokenizer
    expected = backend.encode(text, add_special_tokens=False).ids
    encoded: list[list[int]] = []
    done = threading.Event()

    def encode() -> None:
        encoded.append(chat_tokenizer.encode(text))
        done.set()

    worker = threading.Thread(target=encode)
    worker.start()
    wakeups = 0
    while not done.wait(0.001):  # each wake-up needs the GIL back
        wakeups += 1
    worker.join()
    assert encoded == [expected]
    assert wakeups >= 10, f"this thread ran {wakeups} times while the text was encoded"
