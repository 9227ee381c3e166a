"""The decoupled PPO policy loss with its options, as small pure functions over (B, T) tensors.

    L = −E[ w · min(u·A, clip(u, 1−ε_low, 1+ε_high)·A) ] (+ β · KL(π_θ ‖ π_ref))
    u = π_θ / π_prox  (token- or sequence-level),   w = π_prox / π_behave  (detached)

π_behave produced the tokens (the serving engine's logprobs), π_prox is the trainer's recomputation
with the pre-step weights, π_θ is being optimised. Inputs are per-token logprobs; `loss_mask` marks
the tokens the policy generated. Positions with `loss_mask == 0` are replaced by zeros before any
arithmetic, so whatever values they hold never reach the loss or the gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from trainer.algos.config import LossConfig

Stats = dict[str, Tensor]


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` where `mask`, over all dims; 0 when nothing is masked in."""
    return torch.where(mask, values, 0).sum() / mask.sum().clamp(min=1)


def _masked_max(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask, values, float("-inf")).max() if mask.any() else values.new_zeros(())


# --- importance ratios u = π_θ / π_prox, as logs ---------------------------------------------------


def token_log_ratio(logprobs: Tensor, prox_logprobs: Tensor, mask: Tensor) -> Tensor:  # (B, T)
    """`log π_θ − log π_prox` per token (0 where masked out)."""
    return torch.where(mask, logprobs - prox_logprobs, 0)


def sequence_log_ratio(logprobs: Tensor, prox_logprobs: Tensor, mask: Tensor) -> Tensor:  # (B, T)
    """GSPO (Zheng et al. 2025): the mean masked log-ratio of each sequence, broadcast to its tokens.

    `exp` of it is the geometric mean of the sequence's token ratios; the gradient reaches every
    masked token of the sequence, scaled by 1/|y|. Departs from GSPO only in the denominator:
    π_prox (decoupled PPO) instead of the behaviour policy.
    """
    log_ratio = token_log_ratio(logprobs, prox_logprobs, mask)  # (B, T)
    per_seq = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # (B,)
    return torch.where(mask, per_seq.unsqueeze(-1), 0)  # (B, T)


RATIO_LEVELS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "token": token_log_ratio,
    "sequence": sequence_log_ratio,
}


# --- off-policy token filters (detached) -----------------------------------------------------------


def icepop_keep(prox_logprobs: Tensor, behave_logprobs: Tensor, lower: float, upper: float) -> Tensor:
    """IcePop: True where `lower <= π_prox / π_behave <= upper` (bounds included). (B, T) bool.

    IcePop (Ring-1T, 2025) compares the training and inference engines' probabilities under the same
    weights; with stale samples π_prox is newer than π_behave, so this also drops tokens the policy
    has since moved away from.
    """
    ratio = torch.exp(prox_logprobs - behave_logprobs).detach()  # (B, T)
    return (ratio >= lower) & (ratio <= upper)


def _log1mexp(logp: Tensor) -> Tensor:
    """`log(1 − exp(logp))` for logp <= 0, accurate near both ends, floored at log(1e-30)."""
    out = torch.where(logp > -0.6931, torch.log(-torch.expm1(logp)), torch.log1p(-torch.exp(logp)))
    return out.clamp(min=-69.0776)


def symmetric_binary_kl(logp: Tensor, logq: Tensor) -> Tensor:  # (B, T)
    """KL(p‖q) + KL(q‖p) of Bernoulli(p) and Bernoulli(q) from log p, log q.

    = (p − q)·(log p − log q) + (q − p)·(log(1−p) − log(1−q)); always >= 0.
    """
    logp, logq = logp.clamp(max=0), logq.clamp(max=0)
    p, q = logp.exp(), logq.exp()
    return (p - q) * (logp - logq) + (q - p) * (_log1mexp(logp) - _log1mexp(logq))


def kpop_keep(prox_logprobs: Tensor, behave_logprobs: Tensor, upper: float) -> Tensor:
    """KPop: True where the symmetric binary KL between π_prox and π_behave of the token is <= upper."""
    return symmetric_binary_kl(prox_logprobs.detach(), behave_logprobs.detach()) <= upper  # (B, T)


# --- KL to a reference policy (Schulman's estimators) ----------------------------------------------
# Schulman's estimators assume tokens sampled from π_θ; here they were sampled from π_behave, so under
# staleness they are (slightly) biased estimates of KL(π_θ ‖ π_ref), as in every async RL trainer.


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:  # (B, T)
    """k1 = log π_θ − log π_ref (unbiased, high variance, can be negative)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:  # (B, T)
    """k2 = ½ (log π_ref − log π_θ)² (biased, low variance, >= 0)."""
    return 0.5 * (ref_logprobs - logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:  # (B, T)
    """k3 = (π_ref/π_θ − 1) − log(π_ref/π_θ) (unbiased, low variance, >= 0)."""
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


# --- loss aggregation over (B, T) ------------------------------------------------------------------


def token_mean(values: Tensor, mask: Tensor, max_tokens: int | None = None) -> Tensor:
    """Sum over all masked tokens of the batch / their number (DAPO's token-level loss; the default).

    `max_tokens` is unused.
    """
    return masked_mean(values, mask)


def seq_mean_token_mean(values: Tensor, mask: Tensor, max_tokens: int | None = None) -> Tensor:
    """Mean over sequences of each sequence's token mean (the GRPO paper's 1/G Σ 1/|o_i| Σ_t).

    Sequences with no masked token are left out of the outer mean. `max_tokens` is unused.
    """
    per_seq_tokens = mask.sum(-1)  # (B,)
    per_seq = torch.where(mask, values, 0).sum(-1) / per_seq_tokens.clamp(min=1)  # (B,)
    return masked_mean(per_seq, per_seq_tokens > 0)


def token_sum_norm(values: Tensor, mask: Tensor, max_tokens: int | None = None) -> Tensor:
    """Dr.GRPO: sum over masked tokens / (B · max_tokens), a constant that ignores response lengths.

    `max_tokens` is the generation budget; None falls back to the padded length T of this batch
    (constant within a batch, not across batches of different padding).
    """
    batch, seq_len = mask.shape
    return torch.where(mask, values, 0).sum() / (batch * (max_tokens or seq_len))


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "token_sum_norm": token_sum_norm,
}


# --- the clipped surrogate -------------------------------------------------------------------------


def clipped_surrogate(
    ratio: Tensor,  # (B, T) u = π_θ / π_prox
    advantages: Tensor,  # (B, T)
    eps_low: float,
    eps_high: float,
    dual_clip_c: float | None,
) -> tuple[Tensor, Stats]:
    """Per-token `−min(u·A, clip(u, 1−ε_low, 1+ε_high)·A)`, then for A < 0 at most `c·|A|` (dual clip).

    PPO (Schulman et al. 2017) with DAPO's asymmetric clip-higher and the dual clip of Ye et al. 2020;
    no departure from them.

    Returns the (B, T) loss and (B, T) bool masks of where each clip is active (its gradient is 0).
    """
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    loss = torch.maximum(unclipped, clipped)  # (B, T) = −min(u·A, clip(u)·A)
    clip_low = (advantages < 0) & (ratio < 1 - eps_low)
    clip_high = (advantages > 0) & (ratio > 1 + eps_high)
    masks = {"clip_low": clip_low, "clip_high": clip_high}
    if dual_clip_c is not None:
        dual = (advantages < 0) & (loss > -dual_clip_c * advantages)
        loss = torch.where(dual, -dual_clip_c * advantages, loss)
        masks["dual_clip"] = dual
    return loss, masks


def _offpolicy_filters(prox: Tensor, behave: Tensor, mask: Tensor, config: LossConfig) -> Stats:
    """The (B, T) masks of `loss_mask` tokens that IcePop and KPop drop, for the filters switched on."""
    dropped: Stats = {}
    if config.icepop is not None:
        dropped["icepop"] = mask & ~icepop_keep(prox, behave, config.icepop.lower, config.icepop.upper)
    if config.kpop is not None:
        dropped["kpop"] = mask & ~kpop_keep(prox, behave, config.kpop.upper)
    return dropped


def ppo_loss(
    logprobs: Tensor,  # (B, T) log π_θ, with grad
    prox_logprobs: Tensor,  # (B, T) log π_prox
    behave_logprobs: Tensor,  # (B, T) log π_behave
    advantages: Tensor,  # (B,) or (B, T)
    loss_mask: Tensor,  # (B, T) 1 where the policy generated the token
    config: LossConfig,
    ref_logprobs: Tensor | None = None,  # (B, T) log π_ref, needed when config.kl is set
    entropy: Tensor | None = None,  # (B, T) for the stats only
) -> tuple[Tensor, Stats]:
    """Decoupled PPO (Hilton et al. 2022; AReaL, Fu et al. 2025) with the options of `LossConfig`.

    Where this departs from the papers:
    - `w = π_prox/π_behave` is detached and, with `behave_weight_cap`, clamped to the cap (truncated
      importance sampling); AReaL instead drops tokens above its cap (use IcePop for that).
    - `w` stays token-level even when `ratio_level = "sequence"` (as AReaL does with GSPO): only `u`
      becomes the sequence's geometric mean, and GSPO's clip range (~3e-4) is the user's to set.
    - IcePop/KPop-filtered tokens contribute zero but stay in the aggregation's denominator, as in
      IcePop's objective (the 1/|y| normalisation is unchanged by the mask). A sequence-level ratio
      averages over the tokens the filters keep.
    - Clip and dual-clip fractions are over the kept tokens; filter fractions over `loss_mask` tokens.
    - The KL term is aggregated over `loss_mask` like the policy term (not filtered by IcePop/KPop),
      and added to the loss (GRPO) rather than folded into the reward (InstructGPT/PPO-RLHF).
    """
    mask = loss_mask.bool()
    f32 = torch.float32
    logprobs = torch.where(mask, logprobs.to(f32), 0)
    prox = torch.where(mask, prox_logprobs.to(f32), 0).detach()
    behave = torch.where(mask, behave_logprobs.to(f32), 0).detach()
    adv = advantages.to(f32).unsqueeze(-1) if advantages.dim() == 1 else advantages.to(f32)
    adv = torch.where(mask, adv.expand_as(mask), 0).detach()  # (B, T)

    filtered = _offpolicy_filters(prox, behave, mask, config)  # name -> (B, T) dropped tokens
    keep = mask  # (B, T)
    for dropped in filtered.values():
        keep = keep & ~dropped
    ratio = torch.exp(RATIO_LEVELS[config.ratio_level](logprobs, prox, keep))  # (B, T)
    eps_high = config.eps_clip if config.eps_clip_higher is None else config.eps_clip_higher
    pg, clip_masks = clipped_surrogate(ratio, adv, config.eps_clip, eps_high, config.dual_clip_c)
    raw_weight = torch.exp(prox - behave)  # (B, T) detached
    weight = raw_weight.clamp(max=config.behave_weight_cap or float("inf"))  # (B, T)
    per_token = torch.where(keep, weight * pg, 0)  # (B, T)

    if config.kl is not None:
        if ref_logprobs is None:
            raise ValueError("config.kl is set but no ref_logprobs were given")
        ref = torch.where(mask, ref_logprobs.to(f32), 0).detach()
        kl = KL_ESTIMATORS[config.kl.estimator](logprobs, ref)  # (B, T)
        per_token = per_token + config.kl.coef * torch.where(mask, kl, 0)

    loss = AGGREGATIONS[config.aggregation](per_token, mask, config.max_tokens)
    stats = _loss_stats(logprobs.detach(), prox, behave, ratio.detach(), raw_weight, mask, keep)
    stats.update({f"clip/{k}_frac": masked_mean(v.float(), keep) for k, v in clip_masks.items()})
    stats.update({f"filter/{k}_frac": masked_mean(v.float(), mask) for k, v in filtered.items()})
    if config.kl is not None:
        stats["kl/ref"] = masked_mean(kl.detach(), mask)
    if entropy is not None:
        stats["entropy"] = masked_mean(entropy.detach().to(f32), mask)
    return loss, stats


def _loss_stats(
    logprobs: Tensor, prox: Tensor, behave: Tensor, ratio: Tensor, weight: Tensor, mask: Tensor, keep: Tensor
) -> Stats:
    """Detached diagnostics; KLs use k3 over `loss_mask` tokens (samples come from π_behave)."""
    return {
        "num_tokens": mask.sum().float(),
        "ratio/mean": masked_mean(ratio, keep),
        "ratio/max": _masked_max(ratio, keep),
        "behave_weight/mean": masked_mean(weight, mask),
        "behave_weight/max": _masked_max(weight, mask),
        "kl/behave_theta": masked_mean(kl_k3(behave, logprobs), mask),
        "kl/prox_theta": masked_mean(kl_k3(prox, logprobs), mask),
    }
