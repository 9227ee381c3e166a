"""Policy checkpoints: one full model directory per version (safetensors weights plus the source model's
config and tokenizer files), written atomically, so any directory named `v<version>` is complete.

A checkpoint is what `/update_weights_from_disk` (SGLang, and the CPU engine) and
`serving.models.loading.load_weights_into` read, and what `from_pretrained` can load on its own.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
import uuid
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from serving.models.loading import SAFETENSORS_FILE, SAFETENSORS_INDEX

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^v(\d{6,})$")
# Weight files of other formats in a source model directory; everything else (config, generation
# config, tokenizer, chat template) is copied into every checkpoint.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def checkpoint_name(version: int) -> str:
    """The directory name of `version`'s checkpoint: `v000012`."""
    return f"v{version:06d}"


def list_checkpoints(checkpoint_dir: Path) -> dict[int, Path]:
    """Complete checkpoints under `checkpoint_dir` by version (temporary directories are not listed)."""
    if not checkpoint_dir.is_dir():
        return {}
    found = {}
    for path in checkpoint_dir.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir():
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state as contiguous CPU tensors, one name per shared storage (tied embeddings keep
    their first name, as `save_pretrained` does; safetensors refuses shared tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = tensor.detach().to("cpu").contiguous()
    return tensors


TRAINER_STATE = Path("trainer") / "state.pt"
"""The optimiser's and the running baselines' state inside a checkpoint, when it was saved with them: in
a subdirectory, where no model loader looks for weight files."""


def save_checkpoint(
    model: torch.nn.Module,
    source_dir: Path,
    checkpoint_dir: Path,
    version: int,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write `model`'s weights as `checkpoint_dir/v<version>` with `source_dir`'s non-weight files, and
    `state` (the trainer's own: optimiser moments, baselines) as `TRAINER_STATE` when given.

    Written to a temporary sibling and renamed into place. An existing directory of the same version
    is replaced: it can only be left over from a step that failed before it was recorded.
    """
    started = time.perf_counter()
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / checkpoint_name(version)
    tmp = checkpoint_dir / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(unique_tensors(model), tmp / SAFETENSORS_FILE, metadata={"format": "pt"})
        copy_model_files(source_dir, tmp)
        if state is not None:
            (tmp / TRAINER_STATE).parent.mkdir()
            torch.save(state, tmp / TRAINER_STATE)
        if final.exists():
            logger.warning("replacing %s, left over from a step that was never recorded", final)
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved %s in %.2f s", final, time.perf_counter() - started)
    return final


def copy_model_files(source_dir: Path, target_dir: Path) -> None:
    """Copy config, generation config, tokenizer and template files (everything but weights)."""
    for path in Path(source_dir).iterdir():
        if (
            path.is_file()
            and not path.name.startswith(".")
            and path.name != SAFETENSORS_INDEX
            and not path.name.endswith(_WEIGHT_SUFFIXES)
        ):
            shutil.copy2(path, target_dir / path.name)


def load_trainer_state(checkpoint: Path) -> dict[str, Any] | None:
    """The trainer state saved with a checkpoint; None when it was saved without one."""
    path = Path(checkpoint) / TRAINER_STATE
    if not path.is_file():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def prune_checkpoints(checkpoint_dir: Path, keep: int | None, protect: Collection[int]) -> list[Path]:
    """Delete all but the newest `keep` checkpoints, never a version in `protect` (the served, the best,
    one being evaluated); returns what was deleted. Leftover temporary directories of interrupted saves
    go too."""
    removed: list[Path] = []
    for stale in checkpoint_dir.glob(".v*.tmp-*") if checkpoint_dir.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)
    if keep is None:
        return removed
    versions = list(list_checkpoints(checkpoint_dir).items())
    for version, path in versions[: max(len(versions) - keep, 0)]:
        if version not in protect:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
