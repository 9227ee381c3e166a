"""Token-exact prompts: render the served model's chat template (tools included) and tokenize the text
once, exactly as the model will see it; and the per-token text/bytes that OpenAI logprobs report."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from proxy.errors import OpenAIError

logger = logging.getLogger(__name__)

_TOKEN_BYTES_CACHE = 65536


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

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> list[int]:
        """Prompt token ids of `messages` with the generation prompt appended."""
        return self.encode(self.render_text(messages, tools))

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
        """`render`, in a worker thread when the prompt is long enough for that to pay."""
        size = sum(len(m["content"]) if isinstance(m.get("content"), str) else len(json.dumps(m["content"]))
                   for m in messages)
        if tools:
            size += sum(len(json.dumps(tool)) for tool in tools)
        if size > thread_above_chars:
            return await asyncio.to_thread(self.render, messages, tools)
        return self.render(messages, tools)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (the template already wrote them)."""
        if self._backend is not None:
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
