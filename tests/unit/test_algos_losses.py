"""The decoupled PPO loss: on-policy reduction, clipping, dual clip, masking, w, IcePop/KPop, KL, GSPO."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from trainer.algos.logprobs import token_logprobs
from trainer.algos.losses import (
    KL_ESTIMATORS,
    icepop_keep,
    kpop_keep,
    ppo_loss,
    seq_mean_token_mean,
    sequence_log_ratio,
    symmetric_binary_kl,
    token_mean,
    token_sum_norm,
)
from trainer.config import KLConfig, LossConfig

MASK = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)


def _rand(seed: int, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    return -torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 3  # logprobs in (-3, 0]


def _loss_and_grad(lp: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
    leaf = lp.clone().requires_grad_()
    loss, stats = ppo_loss(leaf, *args, **kwargs)
    loss.backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad, stats


def _ratios(
    ratios: list[float], advantages: list[float], **config: Any
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One sequence whose token ratios u = π_θ/π_prox are exactly `ratios` (π_prox = π_behave = 0.5)."""
    prox = torch.full((1, len(ratios)), math.log(0.5))
    lp = prox + torch.tensor([ratios]).log()
    mask = torch.ones_like(prox, dtype=torch.bool)
    return _loss_and_grad(lp, prox, prox, torch.tensor([advantages]), mask, LossConfig(**config))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
def test_on_policy_loss_is_minus_mean_advantage_and_gradient_is_vanilla_pg(aggregation: str) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 9, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 9, (3, 4), generator=gen)
    adv = torch.randn(3, generator=gen)
    config = LossConfig(aggregation=aggregation)  # type: ignore[arg-type]
    aggregate = {
        "token_mean": token_mean,
        "seq_mean_token_mean": seq_mean_token_mean,
        "token_sum_norm": token_sum_norm,
    }[aggregation]

    theta = logits.clone().requires_grad_()
    lp = token_logprobs(theta, tokens, 0.7)
    loss, stats = ppo_loss(lp, lp.detach(), lp.detach(), adv, MASK, config)
    loss.backward()

    vanilla = logits.clone().requires_grad_()
    vlp = token_logprobs(vanilla, tokens, 0.7)
    aggregate(-(adv[:, None] * vlp).float(), MASK, None).backward()  # −A·∇log π, same aggregation

    expected_loss = aggregate(-adv[:, None].expand(3, 4), MASK, None)
    assert loss.item() == pytest.approx(expected_loss.item(), abs=1e-6)
    if aggregation == "token_mean":
        assert loss.item() == pytest.approx(-(adv[:, None].expand(3, 4)[MASK]).mean().item(), abs=1e-6)
    assert theta.grad is not None and vanilla.grad is not None
    torch.testing.assert_close(theta.grad, vanilla.grad, atol=1e-6, rtol=0)
    assert stats["clip/clip_low_frac"].item() == 0 and stats["clip/clip_high_frac"].item() == 0
    assert stats["kl/behave_theta"].item() == pytest.approx(0, abs=1e-7)


def test_clip_kicks_in_exactly_beyond_one_plus_minus_eps() -> None:
    ratios = [1.27, 1.29, 0.70, 0.81, 0.79, 1.50]
    advs = [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
    loss, grad, stats = _ratios(ratios, advs, eps_clip=0.2, eps_clip_higher=0.28)
    clipped = torch.tensor([[False, True, False, False, True, False]])
    assert (grad[clipped] == 0).all()
    assert (grad[~clipped] != 0).all()
    assert stats["clip/clip_high_frac"].item() == pytest.approx(1 / 6)
    assert stats["clip/clip_low_frac"].item() == pytest.approx(1 / 6)
    # −min(u·A, clip(u)·A) per token, averaged
    per_token = [-1.27, -1.28, -0.70, 0.81, 0.80, 1.50]
    assert loss.item() == pytest.approx(sum(per_token) / 6, abs=1e-6)


def test_symmetric_clip_when_eps_clip_higher_is_none() -> None:
    _, grad, stats = _ratios([1.19, 1.21], [1.0, 1.0], eps_clip=0.2)
    assert grad[0, 0] != 0 and grad[0, 1] == 0
    assert stats["clip/clip_high_frac"].item() == pytest.approx(0.5)


def test_dual_clip_bounds_negative_advantage_loss() -> None:
    ratios, advs = [5.0, 2.0, 5.0], [-1.0, -1.0, 2.0]
    plain, _, _ = _ratios(ratios, advs)
    loss, grad, stats = _ratios(ratios, advs, dual_clip_c=3.0)
    # token 0: max(5·1, 1.2·1) = 5 → bounded to 3·|A| = 3; token 1: 2 < 3 untouched; token 2 (A > 0): −1.2·2
    assert plain.item() == pytest.approx((5.0 + 2.0 - 2.4) / 3, abs=1e-6)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 2.4) / 3, abs=1e-6)
    assert grad[0, 0] == 0 and grad[0, 1] != 0
    assert stats["clip/dual_clip_frac"].item() == pytest.approx(1 / 3)


ALL_OPTIONS = {
    "dual_clip_c": 3.0,
    "eps_clip_higher": 0.28,
    "behave_weight_cap": 2.0,
    "icepop": {"lower": 0.5, "upper": 2.0},
    "kpop": {"upper": 0.5},
    "kl": {"coef": 0.1, "estimator": "k3"},
}


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "token_sum_norm"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_masked_tokens_never_contribute(aggregation: str, ratio_level: str) -> None:
    config = LossConfig(aggregation=aggregation, ratio_level=ratio_level, **ALL_OPTIONS)  # type: ignore[arg-type]
    lp, prox, behave, ref = _rand(1), _rand(2), _rand(3), _rand(4)
    adv = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    loss, grad, stats = _loss_and_grad(lp, prox, behave, adv, MASK, config, ref_logprobs=ref, entropy=-lp)

    junk = [torch.tensor(v) for v in (float("nan"), float("inf"), -float("inf"), 1e30)]

    def spoil(x: torch.Tensor, k: int) -> torch.Tensor:
        return torch.where(MASK, x, junk[k % 4])

    loss2, grad2, stats2 = _loss_and_grad(
        spoil(lp, 0),
        spoil(prox, 1),
        spoil(behave, 2),
        spoil(adv, 0),
        MASK,
        config,
        ref_logprobs=spoil(ref, 3),
        entropy=spoil(-lp, 0),
    )
    assert torch.equal(loss, loss2) and torch.isfinite(loss)
    assert torch.equal(grad, grad2) and (grad[~MASK] == 0).all()
    assert stats.keys() == stats2.keys()
    for key in stats:
        assert torch.equal(stats[key], stats2[key]), key
        assert not stats[key].requires_grad, key


def test_behave_weight_scales_each_token_and_is_capped() -> None:
    prox = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    behave = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))  # w = 1, 2, 5
    adv, mask = torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3, dtype=torch.bool)
    loss, grad, stats = _loss_and_grad(prox, prox, behave, adv, mask, LossConfig())
    assert loss.item() == pytest.approx(-(1 + 2 - 5) / 3, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -2.0, 5.0]]) / 3)  # ∂/∂logπ_θ of −w·u·A / N
    assert stats["behave_weight/max"].item() == pytest.approx(5.0)
    assert stats["behave_weight/mean"].item() == pytest.approx(8 / 3)
    capped, grad_capped, _ = _loss_and_grad(prox, prox, behave, adv, mask, LossConfig(behave_weight_cap=3.0))
    assert capped.item() == pytest.approx(-(1 + 2 - 3) / 3, abs=1e-6)
    torch.testing.assert_close(grad_capped, torch.tensor([[-1.0, -2.0, 3.0]]) / 3)


def test_icepop_masks_exactly_the_tokens_outside_its_bounds() -> None:
    behave_p = torch.tensor([[0.4, 0.4, 0.4, 0.1, 0.1]])
    prox_p = behave_p * torch.tensor([[0.45, 0.55, 1.0, 4.5, 5.5]])  # π_prox/π_behave
    prox, behave = prox_p.log(), behave_p.log()
    assert icepop_keep(prox, behave, 0.5, 5.0).tolist() == [[False, True, True, True, False]]

    adv, mask = torch.ones(1, 5), torch.ones(1, 5, dtype=torch.bool)
    config = LossConfig(icepop={"lower": 0.5, "upper": 5.0})  # type: ignore[arg-type]
    loss, grad, stats = _loss_and_grad(prox, prox, behave, adv, mask, config)
    assert stats["filter/icepop_frac"].item() == pytest.approx(2 / 5)
    assert grad[0, 0] == 0 and grad[0, 4] == 0 and (grad[0, 1:4] != 0).all()
    # filtered tokens count zero but stay in the denominator (IcePop's 1/|y|)
    assert loss.item() == pytest.approx(-(0.55 + 1.0 + 4.5) / 5, abs=1e-5)


def _binary_kl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_symmetric_binary_kl_matches_its_formula() -> None:
    pairs = [(0.5, 0.5), (0.9, 0.5), (0.5, 0.45), (0.01, 0.02), (0.999, 0.3), (1e-6, 0.5)]
    p = torch.tensor([[a for a, _ in pairs]], dtype=torch.float64)
    q = torch.tensor([[b for _, b in pairs]], dtype=torch.float64)
    got = symmetric_binary_kl(p.log(), q.log())
    expected = [_binary_kl(a, b) + _binary_kl(b, a) for a, b in pairs]
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float64), atol=1e-9, rtol=1e-7)


def test_kpop_masks_exactly_the_tokens_above_its_bound() -> None:
    # symmetric binary KLs: 0, 0.879, 0.0100, 0.00693, 3.08
    prox_p = torch.tensor([[0.5, 0.9, 0.5, 0.01, 0.999]])
    behave_p = torch.tensor([[0.5, 0.5, 0.45, 0.02, 0.3]])
    prox, behave = prox_p.log(), behave_p.log()
    assert kpop_keep(prox, behave, upper=0.05).tolist() == [[True, False, True, True, False]]
    assert kpop_keep(prox, behave, upper=1.0).tolist() == [[True, True, True, True, False]]

    adv, mask = torch.ones(1, 5), torch.ones(1, 5, dtype=torch.bool)
    _, grad, stats = _loss_and_grad(prox, prox, behave, adv, mask, LossConfig(kpop={"upper": 0.05}))  # type: ignore[arg-type]
    assert stats["filter/kpop_frac"].item() == pytest.approx(2 / 5)
    assert grad[0, 1] == 0 and grad[0, 4] == 0 and (grad[0, [0, 2, 3]] != 0).all()


def test_sequence_ratio_is_the_geometric_mean_over_masked_tokens() -> None:
    lp, prox = _rand(6), _rand(7)
    log_s = sequence_log_ratio(lp, prox, MASK)
    for b in range(3):
        expected = torch.exp((lp[b] - prox[b])[MASK[b]].mean())
        torch.testing.assert_close(log_s[b][MASK[b]].exp(), expected.expand(int(MASK[b].sum())))
        assert (log_s[b][~MASK[b]] == 0).all()

    # Through the loss: small ratios stay unclipped, so L = −mean over tokens of w·s_i·A_i.
    lp = prox + 0.01 * torch.randn(3, 4, generator=torch.Generator().manual_seed(8))
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, _, _ = _loss_and_grad(lp, prox, prox, adv, MASK, LossConfig(ratio_level="sequence"))
    s = sequence_log_ratio(lp, prox, MASK).exp()
    assert loss.item() == pytest.approx(-(s * adv[:, None])[MASK].mean().item(), abs=1e-6)


def test_kl_estimators_match_their_formulas_and_k3_is_non_negative() -> None:
    lp, ref = _rand(9, (64,)), _rand(10, (64,))
    log_r = ref - lp
    torch.testing.assert_close(KL_ESTIMATORS["k1"](lp, ref), lp - ref)
    torch.testing.assert_close(KL_ESTIMATORS["k2"](lp, ref), 0.5 * log_r**2)
    torch.testing.assert_close(KL_ESTIMATORS["k3"](lp, ref), torch.exp(log_r) - 1 - log_r)
    assert (KL_ESTIMATORS["k3"](lp, ref) >= 0).all()
    assert KL_ESTIMATORS["k3"](lp, lp).abs().max() == 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_adds_coef_times_masked_mean(estimator: str) -> None:
    lp, ref, adv = _rand(11), _rand(12), torch.randn(3)
    base, _, _ = _loss_and_grad(lp, lp, lp, adv, MASK, LossConfig())
    config = LossConfig(kl=KLConfig(coef=0.3, estimator=estimator))  # type: ignore[arg-type]
    with_kl, _, stats = _loss_and_grad(lp, lp, lp, adv, MASK, config, ref_logprobs=ref)
    kl = KL_ESTIMATORS[estimator](lp, ref)[MASK].mean()
    assert with_kl.item() == pytest.approx(base.item() + 0.3 * kl.item(), abs=1e-6)
    assert stats["kl/ref"].item() == pytest.approx(kl.item(), abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ppo_loss(lp, lp, lp, adv, MASK, config)


def test_aggregations_by_hand() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert token_mean(values, mask).item() == pytest.approx(10 / 4)
    assert seq_mean_token_mean(values, mask).item() == pytest.approx((2 + 4) / 2)  # empty row left out
    assert token_sum_norm(values, mask, 5).item() == pytest.approx(10 / (3 * 5))
    assert token_sum_norm(values, mask, None).item() == pytest.approx(10 / (3 * 3))
    assert token_mean(values, torch.zeros_like(mask)).item() == 0


def test_stats_report_entropy_and_offpolicy_kls() -> None:
    lp, prox, behave = _rand(13), _rand(14), _rand(15)
    entropy = torch.rand(3, 4)
    _, _, stats = _loss_and_grad(lp, prox, behave, torch.randn(3), MASK, LossConfig(), entropy=entropy)
    assert stats["entropy"].item() == pytest.approx(entropy[MASK].mean().item())
    assert stats["num_tokens"].item() == MASK.sum().item()
    k3_behave = (torch.exp(lp - behave) - 1 - (lp - behave))[MASK].mean()
    assert stats["kl/behave_theta"].item() == pytest.approx(k3_behave.item(), abs=1e-6)
    assert stats["kl/prox_theta"].item() > 0
