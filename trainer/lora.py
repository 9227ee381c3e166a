"""LoRA training with peft (`trainer.lora`): wrap the policy's model with an adapter, read and write the
adapter's tensors and config, and run the base model with the adapter off (the KL reference).

The adapter starts as peft initialises it: A random, B zero, so version 0 computes exactly what the base
model does. Only the adapter's parameters require grad, so only they reach the optimiser. peft is
imported inside the functions: the driver's process imports this module's callers without needing it.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from serving.models.errors import WeightsMismatchError
from trainer.checkpoint import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from trainer.config import LoraConfig

ADAPTER_NAME = "default"
"""peft's name of the one adapter the policy trains."""


def with_lora(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """`model` wrapped with a fresh LoRA adapter on `config.target_modules`, in eval mode; the base
    weights are frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=0.0,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_config, adapter_name=ADAPTER_NAME).eval()


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights under peft's saved names (`base_model.model.<module>.lora_A.weight`), as
    contiguous CPU tensors. Never the base weights of a targeted embedding or lm_head: they are frozen,
    the base model's own."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME, save_embedding_layers=False)
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The adapter's `adapter_config.json` content, as peft's `save_pretrained` writes it."""
    config: dict[str, Any] = model.peft_config[ADAPTER_NAME].to_dict()  # type: ignore[union-attr, index]
    return json.loads(json.dumps(config, default=_json_value))


def _json_value(value: object) -> object:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def load_adapter_into(model: torch.nn.Module, checkpoint: Path) -> None:
    """Load an adapter checkpoint's weights into `model`'s adapter, in place. Strict: the checkpoint must
    hold exactly the adapter's tensors, with their shapes; on a mismatch nothing is copied and
    `WeightsMismatchError` says what."""
    from peft import set_peft_model_state_dict

    path = Path(checkpoint) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise WeightsMismatchError(f"{checkpoint} has no {ADAPTER_WEIGHTS}: not an adapter checkpoint")
    tensors = load_file(path)
    expected = adapter_tensors(model)
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise WeightsMismatchError(
            f"{checkpoint} does not fit the adapter: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    for name, tensor in tensors.items():
        if tensor.shape != expected[name].shape:
            raise WeightsMismatchError(
                f"{name} in {checkpoint} has shape {tuple(tensor.shape)}, "
                f"the adapter {tuple(expected[name].shape)}"
            )
    set_peft_model_state_dict(model, tensors, adapter_name=ADAPTER_NAME)


def is_adapter_checkpoint(path: str | Path) -> bool:
    """Whether `path` is an adapter checkpoint (rather than a full model directory)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


class AdapterDisabled(torch.nn.Module):
    """The base model under a peft model: a forward with the adapter switched off. The KL reference of
    LoRA training, with no copy of the weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.model.disable_adapter():  # type: ignore[operator]
            return self.model(*args, **kwargs)
