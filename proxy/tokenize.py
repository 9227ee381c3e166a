"""Token-exact prompts: render the served model's chat template (tools included) and tokenize the text
once, exactly as the model will see it; and the per-token text/bytes that OpenAI logprobs report."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec

from proxy.errors import OpenAIError

logger = logging.getLogger(__name__)

_TOKEN_BYTES_CACHE = 65536
RENDER_CACHE_ENTRIES = 4096
RENDER_CACHE_COST = 4_000_000
"""The render cache's bound, in token ids plus key bytes (about 150 MB at most)."""
_GIL_FREE_ENCODE_CHARS = 4096
"""Texts longer than this are encoded with the GIL released (`ChatTokenizer.encode`)."""


class RenderCache:
    """Recently rendered prompts, keyed on their encoded (messages, tools): a GRPO group sends the same
    prompt G times and an agent resends its system prompt and tools on every call; rendering and
    tokenizing again would give the same ids. Least recently used first out; thread-safe (long prompts
    are rendered in worker threads)."""

    def __init__(self, max_entries: int = RENDER_CACHE_ENTRIES, max_cost: int = RENDER_CACHE_COST) -> None:
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._max_entries = max_entries
        self._max_cost = max_cost
        self._cost = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> list[int] | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                return None
            self._entries.move_to_end(key)
        return list(ids)  # a copy: callers may extend the prompt they were given

    def put(self, key: bytes, ids: Sequence[int]) -> None:
        cost = len(key) + len(ids)
        if cost > self._max_cost:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = tuple(ids)
            self._cost += cost
            while len(self._entries) > self._max_entries or self._cost > self._max_cost:
                old_key, old_ids = self._entries.popitem(last=False)
                self._cost -= len(old_key) + len(old_ids)


class ChatTokenizer:
    """The served model's tokenizer with its chat template. Thread-safe for rendering and encoding."""

    def __init__(self, tokenizer: Any, context_length: int) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the served model's tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.context_length = context_length
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._byte_decoder = _byte_level_decoder() if _is_byte_level(backend) else None
        self._added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.token_bytes = lru_cache(maxsize=_TOKEN_BYTES_CACHE)(self._token_bytes)
        # OpenAI's `developer` role is the system role of newer models; templates that never heard of
        # it get a system message instead.
        self._knows_developer = "developer" in str(tokenizer.chat_template)
        # A template that reads the clock (Llama 3's date line) renders differently over time: no cache.
        self._rendered = None if "strftime_now" in str(tokenizer.chat_template) else RenderCache()

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """Prompt token ids of `messages` with the generation prompt appended."""
        key = _render_key(messages, tools) if self._rendered is not None else None
        return self._cached_render(key) or self._render_fresh(messages, tools, key)

    def _cached_render(self, key: bytes | None) -> list[int] | None:
        return self._rendered.get(key) if self._rendered is not None and key is not None else None

    def _render_fresh(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, key: bytes | None
    ) -> list[int]:
        ids = self.encode(self.render_text(messages, tools))
        if self._rendered is not None and key is not None:
            self._rendered.put(key, ids)
        return ids

    def render_text(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for `messages` (400 if the template rejects them)."""
        import jinja2

        if not self._knows_developer:
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.TemplateError as exc:
            raise OpenAIError(
                400, f"The model's chat template rejected these messages: {exc}", "invalid_request_error",
                param="messages",
            ) from exc
        return str(text)

    async def render_async(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
        thread_above_chars: int,
    ) -> list[int]:
        """`render`, in a worker thread when the prompt is long enough for that to pay (and not cached)."""
        key = _render_key(messages, tools) if self._rendered is not None else None
        cached = self._cached_render(key)
        if cached is not None:
            return cached
        if template_chars(messages, tools) > thread_above_chars:
            return await asyncio.to_thread(self._render_fresh, messages, tools, key)
        return self._render_fresh(messages, tools, key)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (the template already wrote them). A long text
        goes through `encode_batch`, the same tokenization, because `tokenizers` releases the GIL only
        there: its `encode` holds it throughout, so even in a worker thread a long prompt would stop the
        event loop for the whole of its tokenization."""
        if self._backend is not None:
            if len(text) > _GIL_FREE_ENCODE_CHARS:
                return list(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw (legacy completions) prompt: no chat template, and special tokens added
        exactly as the tokenizer adds them by default (a BOS for Llama-style tokenizers, nothing for
        Qwen's), which is what vLLM and SGLang feed their models for the same request."""
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    @property
    def vocab_size(self) -> int:
        """How many token ids the tokenizer knows (added tokens included): valid ids are below it."""
        return len(self.tokenizer)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def _token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (byte-level BPE); else its decoded text as UTF-8."""
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        if self._byte_decoder is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(ch in self._byte_decoder for ch in piece):
                return bytes(self._byte_decoder[ch] for ch in piece)
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False)).encode()

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def template_chars(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> int:
    """About how many characters the chat template renders for `messages` and `tools`: what tells a
    render worth a worker thread from one faster inline."""
    size = sum(len(m["content"]) if isinstance(m.get("content"), str) else len(json.dumps(m["content"]))
               for m in messages)
    if tools:
        size += sum(len(json.dumps(tool)) for tool in tools)
    return size


def _render_key(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> bytes | None:
    """The render cache's key: the exact JSON of what the template sees (None if it is not JSON, which
    is then rendered every time)."""
    try:
        return msgspec.json.encode((messages, tools))
    except (TypeError, msgspec.EncodeError):
        return None


def load_chat_tokenizer(model_dir: Path, context_length: int | None) -> ChatTokenizer:
    """The tokenizer of the model in `model_dir`, and the context length the proxy enforces: the one
    given, else the model config's max_position_embeddings, else the tokenizer's model_max_length."""
    from serving.models.loading import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    if context_length is None:
        context_length = _model_context_length(model_dir) or int(getattr(tokenizer, "model_max_length", 0))
        if not 0 < context_length < 10**8:
            raise ValueError(f"cannot tell the context length of {model_dir}; set proxy.context_length")
    return ChatTokenizer(tokenizer, context_length)


def _model_context_length(model_dir: Path) -> int | None:
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _is_byte_level(backend: Any) -> bool:
    if backend is None:
        return False
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}
