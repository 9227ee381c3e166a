"""Choosing the next token of every row in a decode step: pure functions over a (B, V) logits tensor.

The logprob we report is of the sampling distribution at the request's temperature,
`log_softmax(logits / T)` in fp32 over the whole vocabulary (T = 1 for greedy requests, as SGLang).
top-k / top-p / min-p only restrict which token is drawn; they do not change the reported logprob.
Penalties, logit_bias and min_new_tokens change the logits themselves (as SGLang's penalizers do),
so they are part of the distribution the logprob describes. So does a grammar: the tokens it forbids
get -inf before the softmax, and the logprob is of the constrained distribution the token was drawn
from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serving.engine.protocol import TOP_K_ALL, SamplingOptions


@dataclass(frozen=True, slots=True)
class RowSampling:
    """What one row needs this step: its options, its output so far and its random stream."""

    options: SamplingOptions
    output_ids: Sequence[int]
    generator: torch.Generator | None
    """None for greedy rows."""
    blocked_ids: tuple[int, ...] = ()
    """Token ids forbidden this step (stop tokens before min_new_tokens)."""
    top_logprobs_num: int = 0
    token_bitmask: torch.Tensor | None = None
    """The row's grammar: the tokens allowed next, packed 32 to an int32 (bit j of word j // 32 is token
    j, xgrammar's layout); None when unconstrained."""


@dataclass(frozen=True, slots=True)
class StepChoice:
    """The tokens chosen for a batch, their logprobs, and top-n alternatives where asked."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]] | None]


def adjust_logits(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Apply penalties, logit_bias, blocked tokens and grammars in place. logits: (B, V) fp32."""
    for i, row in enumerate(rows):
        opts = row.options
        if opts.penalises:
            _penalise_row(logits[i], row.output_ids, opts)
        if row.blocked_ids:
            logits[i, list(row.blocked_ids)] = float("-inf")
        if row.token_bitmask is not None:
            logits[i].masked_fill_(~allowed_tokens(row.token_bitmask, logits.shape[1]), float("-inf"))
    return logits


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A packed bitmask row (W,) int32 as a bool mask (vocab_size,) of the allowed tokens."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # (W, 32), bit j of each word
    return bits.flatten()[:vocab_size].bool()


def _penalise_row(logits: torch.Tensor, output_ids: Sequence[int], opts: SamplingOptions) -> None:
    """SGLang's penalizers: repetition (multiplicative), frequency and presence (over output tokens)."""
    if output_ids and (opts.repetition_penalty != 1.0 or opts.frequency_penalty or opts.presence_penalty):
        ids = torch.tensor(list(output_ids), dtype=torch.long)
        counts = torch.bincount(ids, minlength=logits.shape[0]).to(logits.dtype)  # (V,)
        seen = counts > 0
        if opts.repetition_penalty != 1.0:
            penalised = torch.where(logits < 0, logits * opts.repetition_penalty,
                                    logits / opts.repetition_penalty)
            logits.copy_(torch.where(seen, penalised, logits))
        logits.sub_(counts * opts.frequency_penalty + seen.to(logits.dtype) * opts.presence_penalty)
    for token_id, bias in opts.logit_bias:
        logits[token_id] += bias


def sampling_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) in fp32. logits: (B, V); temperatures: (B, 1)."""
    return torch.log_softmax(logits.float() / temperatures, dim=-1)


def truncate_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero the tokens top-k, then top-p, then min-p exclude (SGLang's order). probs: (V,)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k < TOP_K_ALL:
        keep[top_k:] = False
    if top_p < 1.0:
        before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        keep &= before <= top_p
    if min_p > 0.0:
        keep &= sorted_probs >= sorted_probs[0] * min_p
    keep[0] = True  # the most likely token always survives
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row. probs: (B, V) unnormalised; uniforms: (B,) in [0, 1)."""
    cdf = torch.cumsum(probs, dim=-1)  # (B, V)
    targets = (uniforms * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    return picked.clamp_(max=probs.shape[-1] - 1)


def choose_tokens(logits: torch.Tensor, rows: Sequence[RowSampling]) -> StepChoice:
    """Pick each row's next token and its logprob. logits: (B, V), modified in place."""
    logits = adjust_logits(logits.float(), rows)
    temperatures = torch.tensor([[r.options.temperature] for r in rows], dtype=torch.float32)  # (B, 1)
    logprobs = sampling_logprobs(logits, temperatures)  # (B, V)
    tokens = torch.argmax(logits, dim=-1)  # (B,) greedy rows keep this
    sampled = [i for i, r in enumerate(rows) if not r.options.greedy]
    if sampled:
        probs = logprobs[sampled].exp()  # (S, V)
        for j, i in enumerate(sampled):
            opts = rows[i].options
            if opts.truncates:
                probs[j] = truncate_probs(probs[j], opts.top_k, opts.top_p, opts.min_p)
        uniforms = torch.cat([torch.rand(1, generator=rows[i].generator) for i in sampled])  # (S,)
        tokens[sampled] = draw(probs, uniforms)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)  # (B,)
    top = [_top_logprobs(logprobs[i], r.top_logprobs_num) for i, r in enumerate(rows)]
    return StepChoice(token_ids=tokens.tolist(), logprobs=chosen.tolist(), top_logprobs=top)


def _top_logprobs(row: torch.Tensor, n: int) -> list[tuple[float, int]] | None:
    if n <= 0:
        return None
    values, ids = torch.topk(row, min(n, row.shape[0]))
    # Tokens a grammar forbids have no probability: they are not alternatives (nor valid JSON).
    return [(value, token) for value, token in zip(values.tolist(), ids.tolist(), strict=True)
            if value != float("-inf")]
