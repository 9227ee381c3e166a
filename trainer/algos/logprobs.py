"""Per-token logprobs and entropies of the sampling distribution, without duplicating (B, T, V) in fp32.

The serving engine reports logprobs of the distribution it sampled from: `softmax(logits / T)` at the
request's temperature, with greedy requests (T = 0) reported at T = 1. The trainer must compute the
same quantity, or `π_θ / π_behave` is wrong from the first step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DEFAULT_CHUNK_TOKENS = 1024
"""Rows of the vocabulary-sized fp32 buffer alive at once (1024 × 152k vocab × 4 B ≈ 620 MB)."""


def _temperature(temperature: float | Tensor, logits: Tensor) -> Tensor:
    """T as a (B, 1, 1) tensor; T <= 0 (greedy) counts as 1, as the serving engine reports it."""
    batch_size = logits.shape[0]
    t = torch.as_tensor(temperature, dtype=_compute_dtype(logits.dtype), device=logits.device)
    t = torch.where(t > 0, t, torch.ones_like(t))
    return t.expand(batch_size).reshape(batch_size, 1, 1)  # (B, 1, 1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp16/bf16 logits are upcast to fp32; fp64 stays fp64 (gradient checks run in double).
    return torch.promote_types(dtype, torch.float32)


def _chunks(seq_len: int, batch_size: int, chunk_tokens: int) -> list[slice]:
    step = max(1, chunk_tokens // max(batch_size, 1))
    return [slice(s, min(s + step, seq_len)) for s in range(0, seq_len, step)]


class _TokenLogprobs(torch.autograd.Function):
    """Chunked `log_softmax(logits / T).gather(tokens)` that recomputes the softmax in backward.

    Forward keeps only a reference to `logits` and the (B, T) logsumexp; backward rebuilds one chunk's
    softmax at a time, so peak extra memory is one fp32 chunk, not a full (B, T, V) fp32 copy (autograd
    through `log_softmax` would save two).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: Tensor,  # (B, T, V)
        tokens: Tensor,  # (B, T)
        temp: Tensor,  # (B, 1, 1)
        chunk_tokens: int,
    ) -> Tensor:
        batch, seq_len, _ = logits.shape
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(batch, seq_len, dtype=dtype, device=logits.device)  # (B, T)
        lse = torch.empty_like(out)  # (B, T)
        for sl in _chunks(seq_len, batch, chunk_tokens):
            scaled = logits[:, sl].to(dtype) / temp  # (B, c, V)
            lse[:, sl] = torch.logsumexp(scaled, dim=-1)
            picked = scaled.gather(-1, tokens[:, sl].unsqueeze(-1)).squeeze(-1)  # (B, c)
            out[:, sl] = picked - lse[:, sl]
        ctx.save_for_backward(logits, tokens, temp, lse)
        ctx.chunk_tokens = chunk_tokens  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor
    ) -> tuple[Tensor | None, None, None, None]:
        logits, tokens, temp, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        batch, seq_len, _ = logits.shape
        dtype = lse.dtype
        grad_logits = torch.empty_like(logits)  # (B, T, V)
        for sl in _chunks(seq_len, batch, ctx.chunk_tokens):  # type: ignore[attr-defined]
            g = grad_out[:, sl].to(dtype).unsqueeze(-1)  # (B, c, 1)
            probs = torch.exp(logits[:, sl].to(dtype) / temp - lse[:, sl].unsqueeze(-1))
            # d logp(y) / d x = onehot(y) - softmax(x), then the chain rule through x = logits / T.
            grad = (-g * probs).scatter_add_(-1, tokens[:, sl].unsqueeze(-1), g)  # (B, c, V)
            grad_logits[:, sl] = grad / temp
        return grad_logits, None, None, None


def token_logprobs(
    logits: Tensor,  # (B, T, V)
    tokens: Tensor,  # (B, T)
    temperature: float | Tensor = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:  # (B, T)
    """`log_softmax(logits / T)[b, t, tokens[b, t]]` in fp32 (fp64 if the logits are fp64).

    `logits[b, t]` must already be the distribution `tokens[b, t]` was sampled from: the caller shifts
    (`logits[:, :-1]` against `input_ids[:, 1:]`). `temperature` is a float or a (B,) tensor of
    per-sequence temperatures; T <= 0 (greedy) is taken as 1, matching the serving engine.

    Departs from the textbook `log_softmax(...).gather(...)` only in memory: the result and its gradient
    are the same, computed `chunk_tokens` rows at a time with the softmax recomputed in backward.
    No gradient flows to `temperature`.
    """
    temp = _temperature(temperature, logits)  # (B, 1, 1)
    return _TokenLogprobs.apply(logits, tokens.long(), temp, chunk_tokens)


def entropy_from_logits(
    logits: Tensor,  # (B, T, V)
    temperature: float | Tensor = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:  # (B, T)
    """Entropy `-Σ_v p log p` of `softmax(logits / T)` per position, in fp32, chunked over T.

    Meant for statistics: call it under `torch.no_grad()` to get the memory saving; with autograd on,
    each chunk keeps its activations for backward (correct, but no cheaper than the unchunked form).
    """
    batch, seq_len, _ = logits.shape
    temp = _temperature(temperature, logits)  # (B, 1, 1)
    dtype = _compute_dtype(logits.dtype)
    parts = []
    for sl in _chunks(seq_len, batch, chunk_tokens):
        logp = F.log_softmax(logits[:, sl].to(dtype) / temp, dim=-1)  # (B, c, V)
        parts.append(-(logp.exp() * logp).sum(-1))  # (B, c)
    if not parts:
        return logits.new_zeros(batch, 0, dtype=dtype)
    return torch.cat(parts, dim=1)  # (B, T)
