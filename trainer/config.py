"""The trainer's configuration: the RL algorithm (its sub-configs are in `trainer.algos.config`), the
optimisation and claiming of samples, checkpoints, weight pushes and Ray placement."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
from trainer.telemetry.config import MlflowConfig, WandbConfig

__all__ = [
    "AdvantageConfig",
    "AlgorithmConfig",
    "DistributedWeightsConfig",
    "DrGRPOAdvantageConfig",
    "GRPOAdvantageConfig",
    "IcePopConfig",
    "KLConfig",
    "KPopConfig",
    "LoraConfig",
    "LossConfig",
    "MlflowConfig",
    "PromotionConfig",
    "RLOOAdvantageConfig",
    "RayConfig",
    "TrainerConfig",
    "UngroupedBaselineConfig",
    "WandbConfig",
    "WeightPushConfig",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AlgorithmConfig(_Strict):
    """The RL algorithm: advantage estimator and policy loss (the policy checks at start-up that every kind
    has a function registered: trainer/algos/registries.py)."""

    advantage: AdvantageConfig = Field(default_factory=GRPOAdvantageConfig)
    """Group baseline for rewards → advantages."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy loss."""
    ungrouped: UngroupedBaselineConfig = Field(default_factory=UngroupedBaselineConfig)
    """The baseline of samples that have no group."""


class RayConfig(_Strict):
    """Where the trainer's Ray actors run: one policy actor, or `num_workers` data-parallel ranks
    (`trainer/distributed/`, docs/architecture.md, "Data-parallel training").

    On a cluster of several machines, paths the ranks and the driver share must be on a filesystem every
    node mounts at the same path: the checkpoint directory (`trainer.checkpoint_dir`: rank 0 writes it,
    every rank reads it back when resuming or going back to the best version, and the workers read it with
    the disk weight push) and the run directory; the model directory must exist on every node. Without a
    shared filesystem, use `trainer.weights.strategy = "distributed"` to reach the workers; checkpoints are
    then written by rank 0 on its own node, and a resume needs that checkpoint copied to the same path on
    every rank's node first."""

    address: str | None = None
    """An existing cluster to join (`host:port` of its head, `ray://…` or `auto`); None starts a local
    Ray instance for this process."""
    temp_dir: Path | None = None
    """Ray's session directory for a local instance (keep it short: Unix socket paths are limited to
    107 bytes); None uses Ray's default under /tmp."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs a local instance may schedule; None lets Ray count them."""
    actor_num_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for the policy actor, or for each rank (a scheduling reservation; torch threads are
    `num_threads`)."""
    num_workers: int = Field(1, ge=1)
    """Training ranks. 1 is one policy actor; more start that many ranks in a placement group, each a
    torch.distributed rank training its share of every minibatch in DistributedDataParallel: the update
    equals one actor's on the same batch."""
    actor_num_gpus: int = Field(0, ge=0, le=1)
    """GPUs per rank: 1 trains each rank on a GPU of its own with the NCCL backend (even with one rank);
    0 trains on CPU, over gloo when there are several ranks."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the ranks' bundles spread over the cluster's nodes (Ray placement group strategies): PACK on
    as few nodes as fit, SPREAD over as many as possible, STRICT_ variants fail rather than bend."""
    placement_timeout_s: float = Field(300.0, gt=0)
    """How long to wait for the cluster to have room for every rank before failing."""
    collective_timeout_s: float = Field(1800.0, gt=0)
    """How long a rank waits for the others, at the rendezvous or any collective, before failing."""


class DistributedWeightsConfig(_Strict):
    """The weight-update process group of `strategy: distributed` (trainer/weights/distributed.py): the
    policy actor is its rank 0 and hosts its store; every worker joins it."""

    master_address: str | None = None
    """The address the workers reach the policy actor at; None: the actor machine's own address on the
    route to the first worker (the loopback address when the workers are on loopback)."""
    master_port: int | None = Field(None, ge=1, le=65535)
    """The port of the group's store on the actor's machine; None: one free there, drawn each time the
    group is made."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """`auto`: NCCL when the policy actor sees a GPU, else gloo. The CPU engine takes gloo only."""
    bucket_mb: float = Field(512.0, gt=0)
    """Most tensor bytes (MiB) per `/update_weights_from_distributed` call: each bucket is read from the
    checkpoint and broadcast on its own, so this bounds the memory a bucket takes on each side."""
    group_name: str = Field("flywheel-weights", min_length=1)
    """The group's name on the workers (a worker is in one group of a name at a time)."""
    timeout_s: float = Field(600.0, gt=0)
    """How long the policy actor waits for every worker to join the group, and for a broadcast to
    complete, before the push fails."""


class WeightPushConfig(_Strict):
    """How a new version reaches the serving workers: a checkpoint every worker reads
    (`/update_weights_from_disk`), or tensors broadcast over a process group."""

    strategy: Literal["disk", "distributed"] = "disk"
    """`disk`: each worker reads the version's checkpoint itself, so the checkpoint directory must be on a
    filesystem the workers share with the trainer. `distributed`: the policy actor broadcasts the
    checkpoint's tensors to every worker (SGLang's `/update_weights_from_distributed`; options in
    `distributed`), for workers on other machines with no shared filesystem."""
    distributed: DistributedWeightsConfig = Field(default_factory=DistributedWeightsConfig)
    """The process group of the `distributed` strategy."""
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


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of Llama, Qwen and Mistral style models."""


class LoraConfig(_Strict):
    """LoRA training (`trainer/lora.py`): the base weights stay frozen and only a low-rank adapter on
    `target_modules` is trained. Checkpoints then hold the adapter alone, and the workers load each
    version with `/load_lora_adapter` under `serving.lora_adapter` (`trainer/weights/lora.py`). There is
    no dropout: the policy runs in eval mode, so that its logprobs are the sampler's."""

    rank: int = Field(8, ge=1)
    """r: the adapter's rank. With SGLang workers, `--max-lora-rank` must be at least this."""
    alpha: int = Field(16, ge=1)
    """lora_alpha: the adapter's output is scaled by alpha / rank."""
    target_modules: tuple[str, ...] = Field(LORA_TARGET_MODULES, min_length=1)
    """Names (last component) of the linear layers that get an adapter. With SGLang workers,
    `--lora-target-modules` must include them."""


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
    micro_batch_tokens: int | None = Field(None, ge=2)
    """Padded tokens per forward/backward: a rank's rows, longest first, are packed into micro-batches of
    at most this many rows × longest row (and at most `micro_batch_size` rows when that is set too); a
    row longer than this goes alone. Accumulation weights as for `micro_batch_size`. None = no limit."""
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
    """Where checkpoints (one full model directory per version, with the trainer state a resume needs)
    go; None = `<run dir>/checkpoints`. It also holds `.claim-token`, the claim of the step in flight,
    which a restart gives back."""
    keep_checkpoints: int | None = Field(3, ge=1)
    """Newest checkpoints kept on disk (older ones are deleted after their successor is recorded);
    None keeps all. The served version, the best version and candidates being evaluated are always
    kept as well. The trainer state (optimiser moments, baselines, generators: about twice the weights
    again) is kept only in the checkpoints training may go on from, the newest (the version trained on
    from), the best and candidates; other kept checkpoints stay servable but cannot be resumed from
    exactly."""
    num_threads: int | None = Field(None, ge=1)
    """torch threads in the policy actor; None keeps torch's default. Use 1 when the engine and the
    trainer share 2 cores."""
    seed: int = 0
    """Seed of the policy actor's generators (torch's, the minibatch shuffle's, Python's `random`,
    numpy's); a resume restores their saved states instead."""
    weights: WeightPushConfig = Field(default_factory=WeightPushConfig)
    """How new weights reach the workers."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter instead of every weight; None = full fine-tuning."""
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)
    """Whether a new version must pass an evaluation before it is served."""
    worker_wait_s: float = Field(600.0, ge=0)
    """At start, how long to wait for every worker's /health (they may still be loading the model)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Ray cluster and actor placement."""
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve the trainer's Prometheus metrics on this port (docs/metrics.md); 0 draws a free one (logged);
    None serves none. `flywheel up` picks a free port when this is None, and prints it."""
    metrics_host: str = "127.0.0.1"
    """Interface the metrics endpoint listens on; 0.0.0.0 for a Prometheus on another machine."""
    tensorboard: bool = True
    """Write each step's metrics as TensorBoard event files under `<run dir>/tensorboard`."""
    wandb: WandbConfig | None = None
    """Log each step's metrics to a Weights & Biases run; None: off."""
    mlflow: MlflowConfig | None = None
    """Log each step's metrics to an MLflow run; None: off."""

    @model_validator(mode="after")
    def _lora_pushes_can_work(self) -> TrainerConfig:
        """A LoRA push unloads the served adapter before loading the next, and SGLang's unload waits for
        every request using it: in-flight requests must end at the pause (`abort`), or the push would wait
        on requests that a pause holds. Eval-gated promotion loads full checkpoints on its eval worker."""
        if self.lora is None:
            return self
        if self.weights.pause_mode != "abort":
            raise ValueError(
                f"trainer.lora needs trainer.weights.pause_mode = abort, not {self.weights.pause_mode!r}"
            )
        if self.promotion.enabled:
            raise ValueError("trainer.lora cannot be combined with trainer.promotion (full checkpoints only)")
        if self.weights.strategy == "distributed":
            raise ValueError(
                "trainer.weights.strategy=distributed sends whole models, and LoRA training pushes adapters: "
                "leave the strategy at disk with trainer.lora"
            )
        return self
