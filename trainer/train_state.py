"""The trainer state a checkpoint carries beside its weights, so that training resumes exactly: the
optimiser's state, the running baselines, every random generator a step may draw from, the version, and
the step config the state belongs to.

Pure helpers between the policy (which owns the live objects) and `trainer/checkpoint.py` (which writes
the dict as `TRAINER_STATE`). Everything in the dict is a tensor or a plain Python value, so it loads
with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trainer.algos.baselines import RunningBaselines
from trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

STATE_FORMAT = 2
"""1: optimiser and baselines only (saved with candidates); 2: also RNG states, version and step config."""

_STEP_FIELDS = {
    "algorithm",
    "batch_size",
    "lr",
    "weight_decay",
    "betas",
    "adam_eps",
    "grad_clip",
    "micro_batch_size",
    "ppo_epochs",
    "minibatches",
    "seed",
}
"""The TrainerConfig fields that decide what an update does with a batch."""


def seed_all(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), Python's `random` and numpy's global generator."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def step_config(config: TrainerConfig) -> dict[str, Any]:
    """The part of `config` a saved optimiser state belongs to, as JSON values."""
    return config.model_dump(mode="json", include=_STEP_FIELDS)


def capture_rng(shuffle: torch.Generator) -> dict[str, Any]:
    """Every generator's state: torch's global CPU one, the policy's minibatch `shuffle`, Python's
    `random`, numpy's global one, and each CUDA device's when there is one."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "shuffle": shuffle.get_state(),
        "python": random.getstate(),
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: Mapping[str, Any], shuffle: torch.Generator) -> None:
    """Set every generator `capture_rng` saved (CUDA only on a machine with as many devices)."""
    torch.set_rng_state(rng["torch"])
    shuffle.set_state(rng["shuffle"])
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = rng["numpy"]
    keys = saved["keys"].numpy().astype(np.uint32)
    np.random.set_state((saved["name"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    cuda = rng.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    elif cuda is not None:
        logger.warning("the checkpoint's CUDA generator states are not restored: the devices differ")


def trainer_state(
    optimizer: torch.optim.Optimizer,
    baselines: RunningBaselines,
    shuffle: torch.Generator,
    config: TrainerConfig,
    version: int,
) -> dict[str, Any]:
    """What `TRAINER_STATE` holds for `version`: the dict `restore_trainer_state` reads back."""
    return {
        "format": STATE_FORMAT,
        "version": version,
        "optimizer": optimizer.state_dict(),
        "baselines": baselines.as_dict(),
        "rng": capture_rng(shuffle),
        "step_config": step_config(config),
    }


def restore_trainer_state(
    state: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    shuffle: torch.Generator,
    config: TrainerConfig,
) -> RunningBaselines:
    """Put a saved state back into `optimizer` and the generators; returns the running baselines.

    The optimiser's moments and step counts come from the state, its hyperparameters (learning rate,
    betas, eps, weight decay) from `config`, so that a changed config takes effect; a config that differs
    from the saved one in any field of `step_config` is logged, as the resumed run then departs from an
    uninterrupted one. A format-1 state has no RNG states: the generators keep theirs."""
    optimizer.load_state_dict(state["optimizer"])
    for group in optimizer.param_groups:
        group.update(lr=config.lr, betas=config.betas, eps=config.adam_eps, weight_decay=config.weight_decay)
    saved = state.get("step_config")
    if saved is not None:
        current = step_config(config)
        changed = sorted(key for key in current.keys() | saved.keys() if current.get(key) != saved.get(key))
        if changed:
            logger.warning("resuming with a step config that differs from the checkpoint's in %s", changed)
    if "rng" in state:
        restore_rng(state["rng"], shuffle)
    return RunningBaselines.from_dict(state["baselines"])
