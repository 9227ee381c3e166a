"""The trainer's configuration: the RL algorithm (its sub-configs are in `trainer.algos.config`), the
optimisation and claiming of samples, checkpoints, weight pushes and Ray placement."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.algos.advantages import ADVANTAGE_FNS
from trainer.algos.config import (
    AdvantageConfig,
    DrGRPOAdvantageConfig,
    GRPOAdvantageConfig,
    IcePopConfig,
    KLConfig,
    KPopConfig,
    LossConfig,
    RLOOAdvantageConfig,
    UngroupedBaselineConfig,
)
from trainer.algos.losses import AGGREGATIONS, KL_ESTIMATORS, RATIO_LEVELS

__all__ = [
    "AdvantageConfig",
    "AlgorithmConfig",
    "DrGRPOAdvantageConfig",
    "GRPOAdvantageConfig",
    "IcePopConfig",
    "KLConfig",
    "KPopConfig",
    "LossConfig",
    "PromotionConfig",
    "RLOOAdvantageConfig",
    "RayConfig",
    "TrainerConfig",
    "UngroupedBaselineConfig",
    "WeightPushConfig",
    "check_registries",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _literal_values(model: type[BaseModel], field: str) -> set[str]:
    return set(get_args(model.model_fields[field].annotation))


def _check_registry(name: str, kinds: set[str], registry: Mapping[str, object]) -> None:
    missing = kinds - set(registry)
    if missing:
        raise ValueError(f"no {name} registered for {sorted(missing)}; registered: {sorted(registry)}")


def check_registries() -> None:
    """Every kind a config can name has a function behind it; raise ValueError naming the gaps."""
    advantage_models = get_args(get_args(AdvantageConfig)[0])  # the union's members
    advantage_kinds = set().union(*(_literal_values(m, "kind") for m in advantage_models))
    _check_registry("advantage estimator", advantage_kinds, ADVANTAGE_FNS)
    _check_registry("ratio level", _literal_values(LossConfig, "ratio_level"), RATIO_LEVELS)
    _check_registry("loss aggregation", _literal_values(LossConfig, "aggregation"), AGGREGATIONS)
    _check_registry("KL estimator", _literal_values(KLConfig, "estimator"), KL_ESTIMATORS)


class AlgorithmConfig(_Strict):
    """The RL algorithm: advantage estimator and policy loss. Validating it checks the registries."""

    advantage: AdvantageConfig = Field(default_factory=GRPOAdvantageConfig)
    """Group baseline for rewards → advantages."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy loss."""
    ungrouped: UngroupedBaselineConfig = Field(default_factory=UngroupedBaselineConfig)
    """The baseline of samples that have no group."""

    @model_validator(mode="after")
    def _registries_cover_kinds(self) -> AlgorithmConfig:
        check_registries()
        return self


class RayConfig(_Strict):
    """Where the trainer's Ray actors run."""

    address: str | None = None
    """An existing cluster (`ray://…` or `auto`); None starts a local Ray instance for this process."""
    temp_dir: Path | None = None
    """Ray's session directory for a local instance (keep it short: Unix socket paths are limited to
    107 bytes); None uses Ray's default under /tmp."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs a local instance may schedule; None lets Ray count them."""
    actor_num_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for the policy actor (a scheduling reservation; torch threads are `num_threads`)."""


class WeightPushConfig(_Strict):
    """How a new checkpoint reaches the serving workers (`/update_weights_from_disk` on every worker)."""

    pause_mode: Literal["in_place", "retract", "abort"] | None = "abort"
    """Pause generation with this mode before the update and continue after it.

    `abort` (the default): in-flight requests end at once with their partial output and the proxy
    resumes each as prompt + tokens so far on the new weights (proxy/resume.py), so every token is
    generated, KV cache included, by the version recorded for it, and the push never waits for long
    generations. It works on every SGLang version (older ones only abort) and on the CPU engine.
    `retract` does the same inside newer SGLang (requests requeued, prefilled again on continue);
    `in_place` keeps requests and their old-weight KV cache (fastest; per-token versions come from the
    worker's `weight_versions` spans). None relies on SGLang's writer lock: the update waits for every
    in-flight request to finish and holds new ones back meanwhile (a stalled trainer with agents that
    generate for minutes)."""
    flush_cache: bool = True
    """Drop the workers' prefix caches with the update (their entries belong to the old weights)."""


class PromotionConfig(_Strict):
    """Eval-gated promotion: every new version is a candidate, evaluated on a held-out eval set before any
    serving worker gets it (the evaluation itself is configured in `online.eval`)."""

    enabled: bool = False
    """Gate every new version on its evaluation; False pushes each version to the workers at once."""
    margin: float = Field(0.0, ge=0)
    """A candidate is promoted when its eval score is at least the best promoted version's minus this."""
    min_better_items: int = Field(0, ge=0)
    """And, when above 0, when it scores higher than the best version on at least this many eval items."""


class TrainerConfig(_Strict):
    """The asynchronous RL trainer: which samples it claims, how it optimises, where checkpoints go."""

    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimator and policy loss."""
    batch_size: int = Field(16, ge=1)
    """Trajectories per step. Whole groups are claimed, so a step may get fewer; never more."""
    max_head_offpolicyness: int = Field(0, ge=0)
    """η: the oldest generated token of a trained sample is at most η versions behind the trainer's
    current version. 0 is synchronous training: only samples of the current version are claimed."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate (constant)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW β1, β2."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW ε."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient L2 norm to this before each optimiser step; None = no clipping
    (the norm is still reported)."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Trajectories per forward/backward; gradients accumulate over micro-batches, each weighted by its
    share of the minibatch's aggregation denominator (its masked tokens for token_mean), so the update
    equals one pass over the whole minibatch. None = the whole minibatch in one pass."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each claimed batch."""
    minibatches: int = Field(1, ge=1)
    """Optimiser steps per epoch: the batch is split into this many minibatches (one policy version
    is still pushed per claimed batch). With ppo_epochs = minibatches = 1, π_prox is read off the
    training forward itself (same weights, one forward saved)."""
    total_steps: int | None = Field(None, ge=1)
    """Stop once the policy version reaches this; None = run until stopped."""
    poll_interval_s: float = Field(1.0, gt=0)
    """Wait between claims that found nothing to train on."""
    claim_lease_s: float = Field(600.0, gt=0)
    """A claim older than this may be taken over by another trainer (this one is presumed dead)."""
    checkpoint_dir: Path | None = None
    """Where checkpoints (one full model directory per version) go; None = `<run dir>/checkpoints`."""
    keep_checkpoints: int | None = Field(3, ge=1)
    """Newest checkpoints kept on disk (older ones are deleted after their successor is recorded);
    None keeps all. The served version, the best version and candidates being evaluated are always
    kept as well."""
    num_threads: int | None = Field(None, ge=1)
    """torch threads in the policy actor; None keeps torch's default. Use 1 when the engine and the
    trainer share 2 cores."""
    seed: int = 0
    """Seed of torch's generator in the policy actor."""
    weights: WeightPushConfig = Field(default_factory=WeightPushConfig)
    """How new weights reach the workers."""
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    """Whether a new version must pass an evaluation before it is served."""
    worker_wait_s: float = Field(600.0, ge=0)
    """At start, how long to wait for every worker's /health (they may still be loading the model)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Ray cluster and actor placement."""
