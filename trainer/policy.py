"""The policy: a transformers model in fp32 with AdamW, trained by decoupled PPO on claimed batches.

`Policy` is a plain class (unit tests build it directly); the runner wraps it with `ray.remote` so it
lives in its own process. It stays in eval mode while training: dropout would make its logprobs
differ from the sampler's, and the objective needs them to agree.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from serving.models.loading import load_model, load_weights_into
from serving.weight_group import TensorMeta, WeightGroup
from storage.records import TrainingSample
from trainer.algos.advantages import compute_advantages
from trainer.algos.baselines import RunningBaselines, running_advantages, updated
from trainer.algos.logprobs import entropy_from_logits, token_logprobs
from trainer.algos.losses import masked_mean, ppo_loss
from trainer.algos.registries import check_registries
from trainer.batching import TrainBatch, collate
from trainer.checkpoint import load_trainer_state, save_adapter_checkpoint, save_checkpoint
from trainer.config import LossConfig, TrainerConfig
from trainer.lora import AdapterDisabled, adapter_config, adapter_tensors, load_adapter_into, with_lora
from trainer.packing import pack_micro_batches, rank_share
from trainer.step_stats import StatsAccumulator, batch_stats, micro_batch_weight
from trainer.train_state import restore_trainer_state, seed_all, trainer_state
from trainer.weights.broadcast import (
    GroupEndpoint,
    checkpoint_metas,
    group_endpoint,
    plan_buckets,
    read_tensors,
)

logger = logging.getLogger(__name__)


class Policy:
    """The trained model and its optimiser. Every method runs in the actor's process."""

    # Alone by default; `join_data_parallel` makes it one rank of a data-parallel group.
    _rank = 0
    _world_size = 1
    _device = torch.device("cpu")
    _ddp: DistributedDataParallel | None = None

    def __init__(self, model: str, config: TrainerConfig, cache_dir: Path | None = None) -> None:
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # before loading: loading runs torch ops too
        check_registries()  # every kind the config can name has a function
        seed_all(config.seed)
        self._config = config
        loaded = load_model(model, dtype="float32", cache_dir=cache_dir)
        # With `lora`, a peft model whose base weights are frozen: only the adapter reaches the optimiser.
        self._model = loaded.model.eval() if config.lora is None else with_lora(loaded.model, config.lora)
        self._model_dir = loaded.model_dir
        self._pad_id = loaded.tokenizer.pad_token_id or 0
        self._reference = _reference_model(self._model, config)
        self._optimizer = torch.optim.AdamW(
            [p for p in self._model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
        )
        self._shuffle = torch.Generator().manual_seed(config.seed)
        self._baselines = RunningBaselines()

    def model_dir(self) -> str:
        """The directory the initial weights came from (the workers serve the same model)."""
        return str(self._model_dir)

    def load(self, checkpoint_path: str) -> None:
        """Go on from a checkpoint (resuming, or going back to the best version): its weights, and the
        trainer state saved beside them (optimiser state, running baselines, random generators), so the
        next `train_step` on a batch is the one the run that saved it would have taken next (on CPU in
        fp32 bit for bit; docs/architecture.md, "Checkpoints and resume"). Without a saved state the
        optimiser and baselines start afresh."""
        if self._config.lora is not None:  # an adapter checkpoint
            load_adapter_into(self._model, Path(checkpoint_path))
        else:
            load_weights_into(self._model, Path(checkpoint_path))  # type: ignore[arg-type]  # no peft here
        state = load_trainer_state(Path(checkpoint_path))
        if state is None:
            logger.warning("%s has no trainer state: optimiser and baselines start afresh", checkpoint_path)
            self._optimizer.state.clear()
            self._baselines = RunningBaselines()
            return
        self._baselines = restore_trainer_state(state, self._optimizer, self._shuffle, self._config)

    def save(self, checkpoint_dir: str, version: int, with_state: bool = True) -> str:
        """Write the current weights as a full model directory `v<version>`; returns its path. With
        `with_state` (the default) the trainer state goes with them (`trainer/train_state.py`), so that
        training can go on from this version exactly: after a crash, or after a rejected candidate."""
        state = None
        if with_state:
            state = trainer_state(self._optimizer, self._baselines, self._shuffle, self._config, version)
        if self._config.lora is not None:  # the adapter alone: the base weights never change
            tensors, config = adapter_tensors(self._model), adapter_config(self._model)
            return str(save_adapter_checkpoint(tensors, config, Path(checkpoint_dir), version, state))
        return str(save_checkpoint(self._model, self._model_dir, Path(checkpoint_dir), version, state))

    def train_step(self, samples: Sequence[TrainingSample], current_version: int) -> dict[str, float]:
        """One decoupled-PPO update on `samples` (generated by versions <= `current_version`).

        π_prox is the policy before this update: computed under no_grad first when the batch is used
        for several optimiser steps, else read off the one training forward (the same weights).
        """
        started = time.perf_counter()
        config = self._config
        batch = collate(samples, self._pad_id)
        advantages = self._advantages(samples, batch)  # (B,)
        updates = config.ppo_epochs * config.minibatches
        extras = {"advantages": advantages.unsqueeze(-1).expand_as(batch.loss_mask)}  # (B, T-1)
        stats = StatsAccumulator()
        if updates > 1:
            extras["prox"], entropy = self._no_grad_logprobs(batch, with_entropy=True)
            stats.add_means({"entropy": masked_mean(entropy, batch.loss_mask)}, batch.num_tokens)
        if self._reference is not None:
            extras["ref"], _ = self._no_grad_logprobs(batch, with_entropy=False, model=self._reference)
        for _epoch in range(config.ppo_epochs):
            order = (
                torch.randperm(len(batch), generator=self._shuffle)
                if config.minibatches > 1
                else torch.arange(len(batch))
            )
            for rows in torch.tensor_split(order, min(config.minibatches, len(batch))):
                self._update(batch, rows, extras, stats, with_entropy=updates == 1)
        elapsed = time.perf_counter() - started
        result = stats.result()
        result.update(batch_stats(batch, advantages, current_version))
        result.update(
            {
                "perf/train_s": elapsed,
                "perf/tokens_per_s": result["tokens/total"] / max(elapsed, 1e-9),
                "optim/updates": float(updates),
                "optim/lr": config.lr,
            }
        )
        return result

    def join_data_parallel(self, rank: int, world_size: int, device: torch.device) -> None:
        """Become rank `rank` of `world_size` data-parallel ranks (torch.distributed's default group must
        be up: trainer/distributed/worker.py). The model, and the KL reference, move to `device`; the model
        is wrapped in DistributedDataParallel, which gives every rank rank 0's weights. `train_step` then
        trains this rank's share of each minibatch (trainer/packing.py), DDP adds up the ranks' gradients,
        and every rank takes the same optimiser step and returns the same statistics."""
        self._model.to(device)
        if self._reference is not None:
            self._reference.to(device)
        self._rank, self._world_size, self._device = rank, world_size, device
        device_ids = [device] if device.type == "cuda" else None
        self._ddp = DistributedDataParallel(self._model, device_ids=device_ids, forward_sync_buffers=False)

    def _advantages(self, samples: Sequence[TrainingSample], batch: TrainBatch) -> Tensor:  # (B,)
        """The group estimator's advantages; with a running baseline, samples without a group are measured
        against their key's earlier rewards instead, and the baselines then learn this batch's rewards."""
        algorithm = self._config.algorithm
        estimator = algorithm.advantage
        if algorithm.ungrouped.kind != "running":
            return compute_advantages(batch.rewards, batch.group_ids, estimator.kind, estimator.eps)  # (B,)
        advantages = torch.zeros_like(batch.rewards)  # (B,)
        grouped = [i for i, sample in enumerate(samples) if sample.group_id is not None]
        alone = [i for i, sample in enumerate(samples) if sample.group_id is None]
        if grouped:
            group_ids = tuple(batch.group_ids[i] for i in grouped)
            advantages[grouped] = compute_advantages(
                batch.rewards[grouped], group_ids, estimator.kind, estimator.eps
            )
        if alone:
            keys = [samples[i].baseline_key for i in alone]
            rewards = batch.rewards[alone]  # (A,)
            advantages[alone] = running_advantages(rewards, keys, self._baselines).to(advantages.dtype)
            self._baselines = updated(self._baselines, keys, rewards.tolist(), algorithm.ungrouped.decay)
        return advantages

    def _update(
        self,
        batch: TrainBatch,
        rows: Tensor,
        extras: dict[str, Tensor],
        stats: StatsAccumulator,
        with_entropy: bool,
    ) -> None:
        """One optimiser step on batch[rows], accumulated over micro-batches. With several ranks, each
        trains its share of the rows and DDP all-reduces the gradients on its last micro-batch only."""
        config = self._config
        minibatch = batch.select(rows)
        loss_config = config.algorithm.loss
        if loss_config.aggregation == "token_sum_norm" and loss_config.max_tokens is None:
            # Dr.GRPO's constant must be the minibatch's, not each micro-batch's padded length.
            loss_config = loss_config.model_copy(update={"max_tokens": minibatch.targets.shape[1]})
        self._optimizer.zero_grad(set_to_none=True)
        lengths = batch.lengths
        share = rank_share([lengths[int(i)] for i in rows], self._rank, self._world_size)
        mine = rows[torch.tensor(share, dtype=torch.long)]
        micro_rows = _micro_batches(mine, lengths, config)
        total_loss = 0.0
        parts: list[tuple[dict[str, float], float]] = []
        for index, micro in enumerate(micro_rows):
            part = batch.select(micro)
            width = part.targets.shape[1]
            taken = {name: tensor[micro, :width] for name, tensor in extras.items()}
            # The part's share of the whole minibatch's denominator (every rank's rows); DDP averages
            # the ranks' gradients, so × world size makes them add up to the one-process update.
            weight = micro_batch_weight(loss_config.aggregation, part.loss_mask, minibatch.loss_mask)
            last = index == len(micro_rows) - 1
            with self._ddp.no_sync() if self._ddp is not None and not last else contextlib.nullcontext():
                loss, part_stats = self._loss(part, taken, loss_config, with_entropy)
                (loss * weight * self._world_size).backward()
            total_loss += float(loss.detach()) * weight
            parts.append(({name: float(value) for name, value in part_stats.items()}, part.num_tokens))
        if not micro_rows and self._ddp is not None:
            self._idle_pass(self._ddp)
        total_loss, parts = self._gathered(total_loss, parts)
        for means, tokens in parts:
            stats.add_means(means, tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self._model.parameters(), config.grad_clip if config.grad_clip is not None else math.inf
        )
        self._optimizer.step()
        stats.add_means({"loss": total_loss, "grad_norm": grad_norm}, 1)

    def _idle_pass(self, ddp: DistributedDataParallel) -> None:
        """A rank without rows in a minibatch still runs a forward and backward, of a zero loss, to take
        part in DDP's gradient all-reduce (the other ranks would wait for it forever)."""
        input_ids = torch.full((1, 2), self._pad_id, device=self._device)
        (ddp(input_ids=input_ids, use_cache=False).logits.sum() * 0.0).backward()

    def _gathered(
        self, loss: float, parts: list[tuple[dict[str, float], float]]
    ) -> tuple[float, list[tuple[dict[str, float], float]]]:
        """The minibatch loss (the ranks' shares summed) and every rank's micro-batch statistics in rank
        order, the same on every rank; a policy alone has just its own."""
        if self._world_size == 1:
            return loss, parts
        everyone: list[tuple[float, list[tuple[dict[str, float], float]]] | None] = [None] * self._world_size
        dist.all_gather_object(everyone, (loss, parts))
        gathered = [entry for entry in everyone if entry is not None]
        return sum(share for share, _ in gathered), [part for _, ranks in gathered for part in ranks]

    def _loss(
        self, part: TrainBatch, taken: dict[str, Tensor], loss_config: LossConfig, with_entropy: bool
    ) -> tuple[Tensor, dict[str, Tensor]]:
        model = self._ddp if self._ddp is not None else self._model
        part = part.to(self._device)
        taken = {name: tensor.to(self._device) for name, tensor in taken.items()}
        logits = model(input_ids=part.input_ids, use_cache=False).logits[:, :-1]  # (b, t-1, V)
        logprobs = token_logprobs(logits, part.targets, part.temperatures)  # (b, t-1)
        entropy = None
        if with_entropy:
            with torch.no_grad():
                entropy = entropy_from_logits(logits.detach(), part.temperatures)  # (b, t-1)
        prox = taken.get("prox", logprobs.detach())
        loss, stats = ppo_loss(
            logprobs,
            prox,
            part.behave_logprobs,
            taken["advantages"],
            part.loss_mask,
            loss_config,
            ref_logprobs=taken.get("ref"),
            entropy=entropy,
        )
        stats.pop("num_tokens", None)  # the step reports its token counts itself
        mask = part.loss_mask
        gap = torch.where(mask, (prox - part.behave_logprobs).abs(), 0)
        stats["prox_behave/max_abs_diff"] = gap.max() if mask.any() else gap.new_zeros(())
        stats["prox_behave/mean_diff"] = masked_mean(prox - part.behave_logprobs, mask)
        return loss, stats

    @torch.no_grad()
    def _no_grad_logprobs(
        self, batch: TrainBatch, with_entropy: bool, model: torch.nn.Module | None = None
    ) -> tuple[Tensor, Tensor]:
        """Logprobs (and entropies) of `batch`'s targets under `model` (default: the policy), (B, T-1).
        With several ranks each computes its share of the rows, and the shares (zero elsewhere) are
        summed, so every rank gets them all."""
        model = model or self._model
        logprobs = torch.zeros(batch.targets.shape)
        entropy = torch.zeros(batch.targets.shape)
        lengths = batch.lengths
        mine = torch.tensor(rank_share(lengths, self._rank, self._world_size), dtype=torch.long)
        for micro in _micro_batches(mine, lengths, self._config):
            part = batch.select(micro).to(self._device)
            width = part.targets.shape[1]
            logits = model(input_ids=part.input_ids, use_cache=False).logits[:, :-1]
            logprobs[micro, :width] = token_logprobs(logits, part.targets, part.temperatures).cpu()
            if with_entropy:
                entropy[micro, :width] = entropy_from_logits(logits, part.temperatures).cpu()
        if self._world_size > 1:
            both = torch.stack([logprobs, entropy]).to(self._device)
            dist.all_reduce(both)
            logprobs, entropy = both.cpu().unbind()
        return logprobs, entropy

    # ---- the trainer's end of a distributed weight push (trainer/weights/distributed.py), rank 0 -------

    _weight_group: WeightGroup | None = None

    def weight_group_endpoint(
        self, toward_host: str, address: str | None, port: int | None, backend: str
    ) -> GroupEndpoint:
        """Where the weight-update group will meet, its `auto`s resolved here, where its store runs."""
        return group_endpoint(toward_host, address, port, backend)

    def init_weight_group(
        self, endpoint: GroupEndpoint, world_size: int, name: str, timeout_s: float
    ) -> None:
        """Join weight-update group `name` as its rank 0, hosting its store (leaving any group held before);
        returns once every worker has joined too."""
        self.destroy_weight_group()
        self._weight_group = WeightGroup.join(
            endpoint.address, endpoint.port, 0, world_size, name, endpoint.backend, timeout_s
        )

    def weight_buckets(self, checkpoint_path: str, bucket_bytes: int) -> list[list[TensorMeta]]:
        """The checkpoint's tensors, in the buckets of at most `bucket_bytes` a push sends them in."""
        return plan_buckets(checkpoint_metas(Path(checkpoint_path)), bucket_bytes)

    def broadcast_weights(self, checkpoint_path: str, names: list[str]) -> None:
        """Broadcast the checkpoint's tensors `names`, in order, to the weight-update group."""
        group = self._weight_group
        if group is None:
            raise RuntimeError("broadcast_weights before init_weight_group")
        group.broadcast(read_tensors(Path(checkpoint_path), names, group.device))

    def destroy_weight_group(self) -> None:
        """Leave the weight-update group, if in one (its peers' pending broadcasts fail at once)."""
        group, self._weight_group = self._weight_group, None
        if group is not None:
            group.destroy()


def _micro_batches(rows: Tensor, lengths: Sequence[int], config: TrainerConfig) -> list[Tensor]:
    """`rows` (indices into a batch whose rows hold `lengths` tokens) packed into micro-batches."""
    budget, max_rows = config.micro_batch_tokens, config.micro_batch_size
    packed = pack_micro_batches([lengths[int(i)] for i in rows], budget, max_rows)
    return [rows[torch.tensor(part, dtype=torch.long)] for part in packed]


def _reference_model(model: torch.nn.Module, config: TrainerConfig) -> torch.nn.Module | None:
    """The KL penalty's reference (None without one): a frozen copy of the initial weights, or with LoRA
    the base model itself, run with the adapter switched off."""
    if config.algorithm.loss.kl is None:
        return None
    return AdapterDisabled(model) if config.lora is not None else _frozen_copy(model)


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    reference = copy.deepcopy(model).eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference
