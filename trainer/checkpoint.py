"""Policy checkpoints: one full model directory per version (safetensors weights plus the source model's
config and tokenizer files, and the trainer state that resuming needs), written atomically, so any
directory named `v<version>` is complete.

A checkpoint is what `/update_weights_from_disk` (SGLang, and the CPU engine) and
`serving.models.loading.load_weights_into` read, and what `from_pretrained` can load on its own. The
database's `policy_versions` row says which checkpoints count: a directory of a version that was never
recorded is a leftover of a step that died, and is replaced or discarded. Retention keeps the weights of
the newest versions and of those the database protects, but the trainer state (twice the size of the
weights again, with AdamW) only in checkpoints training may go on from.

The trainer also keeps the token of the claim its step in flight holds (`remember_claim`), so that after
a crash the restarted trainer gives those samples back at once instead of waiting for the lease.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection
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
"""The trainer state inside a checkpoint (`trainer/train_state.py`: optimiser, baselines, generators), when
it was saved with one and not pruned since: in a subdirectory, where no model loader looks for weights."""


def save_checkpoint(
    model: torch.nn.Module,
    source_dir: Path,
    checkpoint_dir: Path,
    version: int,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write `model`'s weights as `checkpoint_dir/v<version>` with `source_dir`'s non-weight files, and
    `state` (the trainer's own: `trainer/train_state.py`) as `TRAINER_STATE` when given.

    Every file is written into a temporary sibling and flushed to disk (fsync), then the directory is
    renamed into place and the rename flushed, so a crash at any moment leaves either no `v<version>` or
    a complete one, and never touches another version's. An existing directory of the same version is
    replaced: it can only be left over from a step that died before it was recorded.
    """

    def write(tmp: Path) -> None:
        save_file(unique_tensors(model), tmp / SAFETENSORS_FILE, metadata={"format": "pt"})
        copy_model_files(source_dir, tmp)
        if state is not None:
            (tmp / TRAINER_STATE).parent.mkdir()
            torch.save(state, tmp / TRAINER_STATE)

    return _write_version(checkpoint_dir, version, write)


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
"""peft's file names in an adapter checkpoint (what `/load_lora_adapter` reads, SGLang's and the CPU
engine's)."""


def save_adapter_checkpoint(
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    checkpoint_dir: Path,
    version: int,
    state: dict[str, Any] | None = None,
) -> Path:
    """Write a LoRA adapter (`trainer/lora.py`: its `tensors` under peft's names and its `config`) as
    `checkpoint_dir/v<version>`, versioned and written as atomically as `save_checkpoint` does, with
    `state` as `TRAINER_STATE` when given. The directory holds the adapter alone, not the base model."""

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        if state is not None:
            (tmp / TRAINER_STATE).parent.mkdir()
            torch.save(state, tmp / TRAINER_STATE)

    return _write_version(checkpoint_dir, version, write)


def _write_version(checkpoint_dir: Path, version: int, write: Callable[[Path], None]) -> Path:
    """`write` the files of `v<version>` into a temporary sibling, flush them, rename the directory into
    place (replacing a leftover of the same version) and flush the rename."""
    started = time.perf_counter()
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir / checkpoint_name(version)
    tmp = checkpoint_dir / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_tree(tmp)
        if final.exists():
            logger.warning("replacing %s, left over from a step that was never recorded", final)
            leftover = checkpoint_dir / f".{final.name}.tmp-old-{uuid.uuid4().hex[:8]}"
            final.rename(leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(checkpoint_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved %s in %.2f s", final, time.perf_counter() - started)
    return final


def _fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then each directory (its entries), to disk."""
    for directory, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            with open(os.path.join(directory, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(directory))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    """The trainer state saved with a checkpoint; None when it was saved without one, or the state was
    pruned (see `prune_checkpoints`)."""
    path = Path(checkpoint) / TRAINER_STATE
    if not path.is_file():
        return None
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def prune_checkpoints(
    checkpoint_dir: Path,
    keep: int | None,
    protect: Collection[int],
    resumable: Collection[int] | None = None,
) -> list[Path]:
    """Delete all but the newest `keep` checkpoints, never a version in `protect` (the served, the best,
    one being evaluated); returns what was deleted. Leftover temporary directories of interrupted saves
    go too. With `resumable`, the trainer state is also deleted from every kept checkpoint whose version
    is not in it (the versions training may go on from: the newest, the best, candidates): their weights
    stay servable, but training cannot resume from them exactly."""
    removed: list[Path] = []
    _remove_interrupted_saves(checkpoint_dir)
    versions = list(list_checkpoints(checkpoint_dir).items())
    if keep is not None:
        for version, path in versions[: max(len(versions) - keep, 0)]:
            if version not in protect:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if resumable is not None:
        for version, path in versions:
            state = path / TRAINER_STATE
            if version not in resumable and path not in removed and state.is_file():
                shutil.rmtree(state.parent, ignore_errors=True)
    return removed


def discard_unrecorded(checkpoint_dir: Path, newest_recorded: int) -> list[Path]:
    """Delete the checkpoints of versions after `newest_recorded` (left by steps that died before their
    record) and temporary directories of interrupted saves; returns the checkpoints deleted."""
    _remove_interrupted_saves(checkpoint_dir)
    removed = []
    for version, path in list_checkpoints(checkpoint_dir).items():
        if version > newest_recorded:
            logger.warning("discarding %s: its version was never recorded", path)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _remove_interrupted_saves(checkpoint_dir: Path) -> None:
    """Delete the temporary directories saves that died left behind (never a complete checkpoint)."""
    for stale in checkpoint_dir.glob(".v*.tmp-*") if checkpoint_dir.is_dir() else ():
        shutil.rmtree(stale, ignore_errors=True)


CLAIM_FILE = ".claim-token"
"""The claim token of the step in flight, in the checkpoint directory."""


def remember_claim(checkpoint_dir: Path, claim_token: str) -> None:
    """Note the claim the step about to run holds (replacing the previous step's)."""
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint_dir / f"{CLAIM_FILE}.tmp"
    tmp.write_text(claim_token)
    os.replace(tmp, checkpoint_dir / CLAIM_FILE)


def remembered_claim(checkpoint_dir: Path) -> str | None:
    """The claim token `remember_claim` noted last; None if none."""
    try:
        return (checkpoint_dir / CLAIM_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def forget_claim(checkpoint_dir: Path) -> None:
    """Forget the noted claim (it was given back)."""
    (checkpoint_dir / CLAIM_FILE).unlink(missing_ok=True)
