"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest

from proxy.tokenize import ChatTokenizer
from serving.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer() -> ChatTokenizer:
    """The tiny model's tokenizer as the proxy uses it, with a 64-token context."""
    return ChatTokenizer(build_tokenizer(seed=0), context_length=64)
