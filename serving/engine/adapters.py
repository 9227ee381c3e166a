"""LoRA adapters in the CPU engine: reading a peft adapter directory, and adding each row's adapter to the
base model's linear layers in a forward.

An adapter is what peft's `save_pretrained` writes: `adapter_config.json` and
`adapter_model.safetensors`, tensors named `base_model.model.<module>.lora_A.weight` (r × in) and
`….lora_B.weight` (out × r). A target layer then computes `W x + B (A x) · scaling`, with scaling
`lora_alpha / r` (`lora_alpha / √r` with rsLoRA), in the same operations as peft's LoRA layer, so the
engine's logprobs are the trainer's. The base weights are never touched: a forward hook on each target
layer adds the deltas, for each row the adapter its sequence was admitted with (none: the base model).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_SIDES = {".lora_A.weight": 0, ".lora_B.weight": 1}
# adapter_config.json settings the engine does not implement, with the value that means "off".
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
                "lora_bias": False, "rank_pattern": {}, "alpha_pattern": {}, "trainable_token_indices": None}


class AdapterError(Exception):
    """The directory is not a LoRA adapter this engine can serve over its model; nothing was loaded."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One loaded adapter: its weights per target layer, in the model's dtype. Immutable once read."""

    name: str
    path: str
    scaling: float
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Module name in the model (`model.layers.0.self_attn.q_proj`) → (A (r, in), B (out, r))."""


def read_adapter(model: torch.nn.Module, name: str, path: str) -> LoraAdapter:
    """Read and check the adapter at `path` against `model` (AdapterError says what does not fit)."""
    directory = Path(path)
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
        tensors = load_file(directory / ADAPTER_WEIGHTS)
    except (OSError, ValueError, SafetensorError) as exc:
        raise AdapterError(f"{path} is not a readable LoRA adapter: {exc}") from exc
    rank, scaling = _rank_and_scaling(config, path)
    pairs: dict[str, list[torch.Tensor | None]] = {}
    for key, tensor in tensors.items():
        module, side = _module_and_side(key, path)
        pairs.setdefault(module, [None, None])[side] = tensor
    modules = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    layers = {}
    for module, (a, b) in sorted(pairs.items()):
        layer = modules.get(module)
        if not isinstance(layer, torch.nn.Linear):
            raise AdapterError(f"{path}: the model has no linear layer {module!r}")
        if a is None or b is None:
            raise AdapterError(f"{path}: {module} lacks its lora_A or lora_B weight")
        if tuple(a.shape) != (rank, layer.in_features) or tuple(b.shape) != (layer.out_features, rank):
            raise AdapterError(
                f"{path}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, expected "
                f"{(rank, layer.in_features)} and {(layer.out_features, rank)}"
            )
        layers[module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not layers:
        raise AdapterError(f"{path} has no LoRA weights")
    return LoraAdapter(name=name, path=str(path), scaling=scaling, layers=layers)


def _rank_and_scaling(config: Any, path: str) -> tuple[int, float]:
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{path}/{ADAPTER_CONFIG} is not a LoRA adapter's config")
    for key, off in _UNSUPPORTED.items():
        if config.get(key, off) not in (off, None, False, {}, []):
            raise AdapterError(f"{path}: {key}={config[key]!r} is not supported by the CPU engine")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterError(f"{path}: r and lora_alpha must be numbers, not {rank!r} and {alpha!r}")
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _module_and_side(key: str, path: str) -> tuple[str, int]:
    for suffix, side in _SIDES.items():
        if key.startswith(_PREFIX) and key.endswith(suffix):
            return key[len(_PREFIX): -len(suffix)], side
    raise AdapterError(f"{path}: unexpected tensor {key!r} (only lora_A/lora_B weights are served)")


_Groups = list[tuple[torch.Tensor | None, LoraAdapter]]
_Hook = Callable[[torch.nn.Module, tuple[Any, ...], torch.Tensor], torch.Tensor | None]


class LoraLayers:
    """The forward hooks that add adapters to a model's linear layers, and the rows each adapter covers
    in the forward under way. Used by the decode thread only."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self._hooked: set[str] = set()
        self._groups: _Groups = []

    def install(self, adapter: LoraAdapter) -> None:
        """Hook the layers `adapter` targets (once per layer: later adapters reuse the hooks)."""
        modules = dict(self._model.named_modules())
        for name in sorted(adapter.layers.keys() - self._hooked):
            modules[name].register_forward_hook(self._hook(name))
            self._hooked.add(name)

    @contextmanager
    def rows(self, adapters: Sequence[LoraAdapter | None]) -> Iterator[None]:
        """Within the block, row i of a forward gets `adapters[i]` (None: the base model)."""
        self._groups = _groups(adapters)
        try:
            yield
        finally:
            self._groups = []

    def _hook(self, name: str) -> _Hook:
        def add_deltas(module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor
                       ) -> torch.Tensor | None:
            if not self._groups:
                return None
            x = inputs[0]  # (B, T, in)
            for rows, adapter in self._groups:
                weights = adapter.layers.get(name)
                if weights is None:
                    continue
                a, b = weights
                if rows is None:  # peft's LoRA layer: result + lora_B(lora_A(x)) * scaling
                    output = output + F.linear(F.linear(x, a), b) * adapter.scaling
                else:
                    delta = F.linear(F.linear(x[rows], a), b) * adapter.scaling
                    output = output.index_add(0, rows, delta)
            return output
        return add_deltas


def _groups(adapters: Sequence[LoraAdapter | None]) -> _Groups:
    """Each adapter in use with its row indices (None when it covers every row)."""
    by_adapter: dict[int, tuple[LoraAdapter, list[int]]] = {}
    for row, adapter in enumerate(adapters):
        if adapter is not None:
            by_adapter.setdefault(id(adapter), (adapter, []))[1].append(row)
    return [
        (None if len(rows) == len(adapters) else torch.tensor(rows, dtype=torch.long), adapter)
        for adapter, rows in by_adapter.values()
    ]
