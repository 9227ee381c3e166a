"""Answers of an SGLang worker's /generate made by hand, for unit tests of what the proxy reads from them."""

from __future__ import annotations

from typing import Any


def chunk(text: str, n_tokens: int, finish: str | None = None) -> dict[str, Any]:
    """A /generate answer (or streamed chunk) of `n_tokens` copies of token 7, each with logprob -0.5."""
    meta: dict[str, Any] = {
        "finish_reason": {"type": finish} if finish else None, "id": "r1",
        "output_token_logprobs": [[-0.5, 7, None]] * n_tokens, "weight_version": "default",
    }
    return {"text": text, "output_ids": [7] * n_tokens, "meta_info": meta}
