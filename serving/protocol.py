"""SGLang 0.5.23's native `/generate` wire format: typed request records with sglang's exact key
names, body encoding, error-text extraction and the SSE framing of streamed answers."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
import msgspec

_ERROR_TEXT_LIMIT = 2000


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """`sampling_params` of `POST /generate`, with sglang 0.5.23's exact key names.

    Unset (None) fields are left out of the body, so the server's defaults apply
    (max_new_tokens 128, temperature 1.0, top_k all, skip_special_tokens true).
    0.5.23 answers 400 to unknown keys: there is no `max_tokens` and no `seed`.
    """

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    """Below ~1e-6 SGLang samples greedily."""
    top_p: float | None = None
    top_k: int | None = None
    """-1 means the whole vocabulary."""
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = None
    """Samples per prompt; n > 1 makes the non-stream answer a JSON array."""
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    beam_width: int | None = None
    watermark: dict[str, Any] | None = None
    choice: list[str] | None = None


class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Body of `POST /generate`: exactly one of `input_ids` and `text`.

    Lists of prompts (a batch) are allowed as SGLang allows them; the answer is then an array.
    Fields left at their default are not sent.
    """

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SamplingParams | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    token_ids_logprob: list[int] | None = None
    return_text_in_logprobs: bool | None = None
    return_prompt_token_ids: bool = False
    lora_path: str | None = None
    priority: int | None = None
    stream: bool = False
    """Set by `SGLangClient.generate_stream`; leave it False."""

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("GenerateRequest needs exactly one of input_ids and text")


GenerateInput = GenerateRequest | dict[str, Any]
GenerateOutput = dict[str, Any] | list[dict[str, Any]]


def encode_generate_body(request: GenerateInput, *, stream: bool) -> bytes:
    """JSON bytes of a /generate body with `stream` set as asked. Dicts are sent as given otherwise."""
    if isinstance(request, GenerateRequest):
        if request.stream != stream:
            request = msgspec.structs.replace(request, stream=stream)
        return msgspec.json.encode(request)
    if bool(request.get("stream")) != stream:
        if not stream:
            raise ValueError("request has stream=true: use SGLangClient.generate_stream")
        request = {**request, "stream": True}
    return msgspec.json.encode(request)


def error_message(body: bytes) -> str:
    """The server's error text from an error body: SGLang uses several shapes, and plain text."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace").strip()[:_ERROR_TEXT_LIMIT]
    if isinstance(payload, dict):
        for key in ("error", "message", "detail"):
            value = payload.get(key)
            if isinstance(value, dict) and "message" in value:
                return str(value["message"])
            if value:
                return value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return body.decode("utf-8", "replace")[:_ERROR_TEXT_LIMIT]


def _sse_data(event: bytes) -> bytes | None:
    """The data of one SSE event (its `data:` lines joined), or None for comment-only events."""
    if event.startswith(b"data:") and b"\n" not in event:
        data = event[5:]
        return data[1:] if data[:1] == b" " else data
    parts = []
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].rstrip(b"\r")
            parts.append(data[1:] if data[:1] == b" " else data)
    return b"\n".join(parts) if parts else None


async def iter_sse_data(content: aiohttp.StreamReader) -> AsyncGenerator[bytes, None]:
    """Yield the data of each SSE event. Handles events of any size (cumulative chunks grow with the
    output, past aiohttp's readline limit), split across reads arbitrarily."""
    async for batch in iter_sse_batches(content):
        for data in batch:
            yield data


async def iter_sse_batches(content: aiohttp.StreamReader) -> AsyncGenerator[list[bytes], None]:
    """The data of the SSE events, a list per read of the stream: the events that arrived together
    (never empty; an event split across reads comes with the read that completes it)."""
    buffer = bytearray()
    scan_from = 0
    async for chunk in content.iter_any():
        buffer += chunk
        batch = []
        while True:
            end = buffer.find(b"\n\n", scan_from)
            if end < 0:
                scan_from = max(len(buffer) - 1, 0)
                break
            data = _sse_data(bytes(buffer[:end]))
            del buffer[: end + 2]
            scan_from = 0
            if data is not None:
                batch.append(data)
        if batch:
            yield batch
    tail = bytes(buffer).strip()
    if tail:
        data = _sse_data(tail)
        if data is not None:
            yield [data]
