"""Load a model and tokenizer for serving or training, and reload weights in place from a safetensors
checkpoint (the CPU engine's /update_weights_from_disk reads what the trainer writes)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from serving.models.errors import ModelLoadError, WeightsMismatchError
from serving.models.paths import default_cache_dir, resolve_model_dir
from serving.models.tensors import check_checkpoint, copy_tensors_strict

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "WeightsMismatchError",
    "check_checkpoint",
    "checkpoint_files",
    "copy_tensors_strict",
    "default_cache_dir",
    "load_model",
    "load_tokenizer",
    "load_weights_into",
    "resolve_model_dir",
]

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to serve: weights in eval mode, its tokenizer, where it came from, its name."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_dir: Path
    name: str


def load_model(model: str, *, dtype: str = "float32", cache_dir: Path | None = None) -> LoadedModel:
    """Resolve `model` (see `resolve_model_dir`) and load it in `dtype`, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch_dtype = _torch_dtype(dtype)
    model_dir = resolve_model_dir(model, cache_dir if cache_dir is not None else default_cache_dir())
    started = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    network = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    network.eval()
    logger.info("Loaded %s from %s in %.2f s", model, model_dir, time.perf_counter() - started)
    return LoadedModel(model=network, tokenizer=tokenizer, model_dir=model_dir, name=model)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `model_dir`, with its chat template (a warning if it has none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        logger.warning("%s has no chat template: /v1/chat/completions cannot render prompts", model_dir)
    return tokenizer


def load_weights_into(model: PreTrainedModel, model_dir: Path) -> None:
    """Load the safetensors checkpoint in `model_dir` (one file, or shards with an index) into `model`
    in place. Strict: every tensor of the model must be there (one name per tied group is enough) with
    its shape, and nothing else; on a mismatch nothing is copied and `WeightsMismatchError` says what.
    Values are cast to the model's dtype."""
    import torch
    from safetensors import safe_open

    files = checkpoint_files(Path(model_dir))
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                if name in shapes:
                    raise WeightsMismatchError(f"Tensor {name!r} is in more than one file of {model_dir}")
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    check_checkpoint(model, shapes, source=str(model_dir))
    started = time.perf_counter()
    targets = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    targets[name].copy_(handle.get_tensor(name))
    logger.info("Loaded %d tensors from %s in %.2f s", len(shapes), model_dir, time.perf_counter() - started)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those an index names, else `model.safetensors`, else every
    `*.safetensors` in the directory."""
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(file) for file in files if not file.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names shards that do not exist: {', '.join(absent)}")
        return files
    if (model_dir / SAFETENSORS_FILE).is_file():
        return [model_dir / SAFETENSORS_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No safetensors checkpoint in {model_dir} ({SAFETENSORS_FILE} or an index)")
    return files


def _torch_dtype(dtype: str) -> torch.dtype:
    import torch

    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must name a torch floating-point type such as 'float32', got {dtype!r}")
    return value
