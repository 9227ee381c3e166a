"""Strict checks and copies of named tensors into a model's state: every tensor of the model must be
given (one name per tied group is enough) with its shape, and nothing else, or nothing is copied.

Shared by the safetensors loader, the GGUF converter and the engine's weight updates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from serving.models.errors import WeightsMismatchError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

_MAX_LISTED = 8


def check_checkpoint(model: PreTrainedModel, shapes: Mapping[str, tuple[int, ...]], source: str) -> None:
    """Raise `WeightsMismatchError` unless `shapes` (name → shape) covers exactly the model's state."""
    targets = model.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}  # tied weights are one Parameter under several names
    for name, tensor in targets.items():
        tied.setdefault(id(tensor), []).append(name)
    missing = [" = ".join(names) for names in tied.values() if not any(name in shapes for name in names)]
    unexpected = sorted(set(shapes) - set(targets))
    wrong_shape = [
        f"{name} (checkpoint {list(shape)}, model {list(targets[name].shape)})"
        for name, shape in shapes.items()
        if name in targets and tuple(targets[name].shape) != tuple(shape)
    ]
    found = (("missing", missing), ("unexpected", unexpected), ("with a wrong shape", wrong_shape))
    problems = [
        f"{len(items)} {what}: {', '.join(items[:_MAX_LISTED])}{', …' if len(items) > _MAX_LISTED else ''}"
        for what, items in found
        if items
    ]
    if problems:
        raise WeightsMismatchError(
            f"Checkpoint {source} does not fit the {type(model).__name__} model; nothing was loaded. "
            f"Tensors {'; '.join(problems)}"
        )


def copy_tensors_strict(model: PreTrainedModel, tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy in-memory `tensors` into `model` in place, after `check_checkpoint` has passed."""
    import torch

    check_checkpoint(model, {name: tuple(tensor.shape) for name, tensor in tensors.items()}, source)
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)
