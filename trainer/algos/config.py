"""The algorithm's sub-configs: which advantage estimator, and the policy loss with its options.

They live beside the functions they parametrise so those can take them without importing the trainer's
top-level config; `trainer.config` builds `AlgorithmConfig` from them and checks the registries.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _AdvantageBase(_Strict):
    eps: float = Field(1e-6, gt=0)
    """Added to the group std before dividing (GRPO only; the other estimators ignore it)."""


class GRPOAdvantageConfig(_AdvantageBase):
    """GRPO: `(r - mean_g) / (std_g + eps)` within each group (sample std)."""

    kind: Literal["grpo"] = "grpo"


class DrGRPOAdvantageConfig(_AdvantageBase):
    """Dr.GRPO: `r - mean_g`, no std division. Pair with `aggregation = "token_sum_norm"`."""

    kind: Literal["dr_grpo"] = "dr_grpo"


class RLOOAdvantageConfig(_AdvantageBase):
    """RLOO: `r_i - mean_{j != i} r_j` within each group."""

    kind: Literal["rloo"] = "rloo"


AdvantageConfig = Annotated[
    GRPOAdvantageConfig | DrGRPOAdvantageConfig | RLOOAdvantageConfig, Field(discriminator="kind")
]
"""Which group baseline; groups of one always fall back to the batch baseline with a warning."""


class UngroupedBaselineConfig(_Strict):
    """The baseline of samples without a group (live traffic)."""

    kind: Literal["batch", "running"] = "batch"
    """`batch`: the other samples of the batch (a batch of one keeps its raw reward). `running`: a moving
    average of earlier rewards of the sample's task, else of its online key (trainer/algos/baselines.py),
    kept with the optimiser state; the choice for online training, where a step may see one sample."""
    decay: float = Field(0.9, ge=0, lt=1)
    """`running` only: each new reward moves its key's average by `1 - decay`."""


class IcePopConfig(_Strict):
    """IcePop: drop tokens whose `π_prox / π_behave` lies outside `[lower, upper]`."""

    lower: float = Field(0.5, gt=0, le=1)
    """Smallest kept ratio (inclusive)."""
    upper: float = Field(5.0, ge=1)
    """Largest kept ratio (inclusive)."""


class KPopConfig(_Strict):
    """KPop: drop tokens whose symmetric Bernoulli KL between `π_prox` and `π_behave` exceeds `upper`."""

    upper: float = Field(gt=0)
    """Largest kept `KL(p‖q) + KL(q‖p)`, with p, q the token's probability under π_prox, π_behave."""


class KLConfig(_Strict):
    """A KL penalty to a frozen reference policy, added to the per-token loss."""

    coef: float = Field(ge=0)
    """β: weight of the KL term."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Schulman's estimator of KL(π_θ ‖ π_ref): k1 = log-ratio, k2 = ½ log-ratio², k3 = r − 1 − log r."""


class LossConfig(_Strict):
    """The decoupled PPO loss `−E[w · min(u·A, clip(u, 1−ε, 1+ε_high)·A)]` and its options."""

    eps_clip: float = Field(0.2, gt=0, lt=1)
    """ε: the ratio u is clipped below at 1 − ε (and above at 1 + ε unless `eps_clip_higher` is set)."""
    eps_clip_higher: float | None = Field(None, gt=0)
    """ε_high for the upper clip 1 + ε_high (DAPO's clip-higher, e.g. 0.28); None means ε_high = ε."""
    dual_clip_c: float | None = Field(None, gt=1)
    """Dual clip: for A < 0 the per-token loss is at most c·|A| (Ye et al. 2020, typically 3); None = off."""
    ratio_level: Literal["token", "sequence"] = "token"
    """`u` per token, or per sequence as the geometric mean of its token ratios (GSPO)."""
    behave_weight_cap: float | None = Field(None, gt=0)
    """Clamp `w = π_prox/π_behave` to at most this (truncated importance sampling); None = uncapped."""
    icepop: IcePopConfig | None = None
    """Mask tokens whose π_prox/π_behave is outside [lower, upper]; None = off."""
    kpop: KPopConfig | None = None
    """Mask tokens whose symmetric binary KL between π_prox and π_behave exceeds `upper`; None = off."""
    kl: KLConfig | None = None
    """KL penalty to a reference policy; None = off (no reference model is needed)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "token_sum_norm"] = "token_mean"
    """How per-token losses become one number: mean over all masked tokens of the batch; mean over
    sequences of their token means; or Dr.GRPO's token sum / (B · max_tokens)."""
    max_tokens: int | None = Field(None, ge=1)
    """Dr.GRPO's constant for `token_sum_norm` (the generation budget); None uses the batch's padded T."""
