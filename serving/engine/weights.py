"""Reading a new checkpoint for /update_weights_from_disk, off the decode thread, checked before any copy.

The decode thread later copies the tensors into the live model between two steps, so no step runs on
half-old weights, and a checkpoint that does not fit is refused while the old weights keep serving.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from serving.models.errors import ModelLoadError
from serving.models.loading import checkpoint_files
from serving.models.tensors import check_checkpoint

logger = logging.getLogger(__name__)


class CheckpointError(Exception):
    """The checkpoint cannot be served: absent, unreadable, or not this model's tensors."""


def read_checkpoint(model: torch.nn.Module, model_path: str) -> dict[str, torch.Tensor]:
    """All tensors of the safetensors checkpoint at `model_path`, verified to fit `model` exactly."""
    started = time.perf_counter()
    path = Path(model_path)
    try:
        if not path.is_dir():
            raise CheckpointError(f"{model_path} is not a directory")
        tensors: dict[str, torch.Tensor] = {}
        for file in checkpoint_files(path):
            for name, tensor in load_file(file).items():
                if name in tensors:
                    raise CheckpointError(f"Tensor {name!r} is in more than one file of {model_path}")
                tensors[name] = tensor
        check_checkpoint(model, {name: tuple(t.shape) for name, t in tensors.items()}, source=model_path)  # type: ignore[arg-type]
    except (ModelLoadError, SafetensorError, OSError) as exc:
        raise CheckpointError(str(exc)) from exc
    logger.info("read %d tensors from %s in %.2f s", len(tensors), model_path, time.perf_counter() - started)
    return tensors
