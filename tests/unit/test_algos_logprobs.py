"""token_logprobs and entropy_from_logits against the naive per-token log_softmax."""

from __future__ import annotations

import pytest
import torch

from trainer.algos.logprobs import entropy_from_logits, token_logprobs


def _naive(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    out = torch.empty(tokens.shape, dtype=torch.promote_types(logits.dtype, torch.float32))
    for b in range(tokens.shape[0]):
        for t in range(tokens.shape[1]):
            logp = torch.log_softmax(logits[b, t].to(out.dtype) / temperature, dim=-1)
            out[b, t] = logp[tokens[b, t]]
    return out


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(3, 7, 13, generator=gen) * 3).to(dtype)
    tokens = torch.randint(0, 13, (3, 7), generator=gen)
    return logits, tokens


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_tokens", [1, 4, 1024])
def test_token_logprobs_equal_naive_log_softmax(temperature: float, chunk_tokens: int) -> None:
    logits, tokens = _inputs()
    got = token_logprobs(logits, tokens, temperature, chunk_tokens=chunk_tokens)
    assert got.shape == (3, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got, _naive(logits, tokens, temperature), atol=1e-6, rtol=0)


@pytest.mark.parametrize("greedy", [0.0, -1.0])
def test_greedy_temperature_is_reported_at_one(greedy: float) -> None:
    logits, tokens = _inputs(1)
    torch.testing.assert_close(
        token_logprobs(logits, tokens, greedy), _naive(logits, tokens, 1.0), atol=1e-6, rtol=0
    )


def test_per_sequence_temperatures() -> None:
    logits, tokens = _inputs(2)
    temps = torch.tensor([0.7, 0.0, 1.3])
    got = token_logprobs(logits, tokens, temps)
    for b, t in enumerate([0.7, 1.0, 1.3]):
        torch.testing.assert_close(
            got[b], _naive(logits[b : b + 1], tokens[b : b + 1], t)[0], atol=1e-6, rtol=0
        )


def test_bf16_logits_are_upcast_before_the_softmax() -> None:
    logits, tokens = _inputs(3, torch.bfloat16)
    got = token_logprobs(logits, tokens, 0.7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _naive(logits.float(), tokens, 0.7), atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gradient_equals_autograd_through_log_softmax(temperature: float) -> None:
    logits, tokens = _inputs(4, torch.float64)
    weights = torch.randn(tokens.shape, dtype=torch.float64)
    mine = logits.clone().requires_grad_()
    (token_logprobs(mine, tokens, temperature, chunk_tokens=4) * weights).sum().backward()
    ref = logits.clone().requires_grad_()
    logp = torch.log_softmax(ref / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    (logp * weights).sum().backward()
    assert mine.grad is not None and ref.grad is not None
    torch.testing.assert_close(mine.grad, ref.grad, atol=1e-10, rtol=0)


def test_non_contiguous_shifted_logits() -> None:
    logits, tokens = _inputs(5)
    got = token_logprobs(logits[:, :-1], tokens[:, 1:], 0.7, chunk_tokens=2)
    torch.testing.assert_close(got, _naive(logits[:, :-1], tokens[:, 1:], 0.7), atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_equals_naive(temperature: float) -> None:
    logits, _ = _inputs(6)
    probs = torch.softmax(logits / temperature, dim=-1)
    naive = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(
        entropy_from_logits(logits, temperature, chunk_tokens=4), naive, atol=1e-5, rtol=0
    )
    uniform = torch.zeros(1, 2, 13)
    torch.testing.assert_close(
        entropy_from_logits(uniform), torch.full((1, 2), torch.tensor(13.0).log().item())
    )


def test_backward_keeps_no_vocab_sized_fp32_copy() -> None:
    """Autograd saves only the caller's bf16 logits, not a (B, T, V) fp32 softmax."""
    logits = torch.randn(2, 16, 50, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 50, (2, 16))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(logits, tokens, 0.7, chunk_tokens=8).sum().backward()
    vocab_sized = [t for t in saved if t.dim() == 3 and t.shape[-1] == 50]
    assert [t.dtype for t in vocab_sized] == [torch.bfloat16]
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
