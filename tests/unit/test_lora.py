"""LoRA's refusals: configs whose pushes could not work, and adapter directories the CPU engine cannot
serve over its model (nothing is loaded then); and peft's scaling rules as the engine reads them."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from serving.config import ServingConfig
from serving.engine.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterError, read_adapter
from serving.models.loading import load_model
from tests.support.lora import perturbed_adapter
from trainer.config import TrainerConfig
from trainer.runner import lora_sync


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"weights": {"pause_mode": "in_place"}}, "pause_mode = abort"),
        ({"weights": {"pause_mode": None}}, "pause_mode = abort"),
        ({"promotion": {"enabled": True}}, "trainer.promotion"),
        ({"weights": {"strategy": "distributed"}}, "strategy=distributed"),
    ],
)
def test_lora_refuses_pushes_that_could_not_work(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainerConfig.model_validate({"lora": {}, **settings})


async def test_lora_training_needs_the_adapter_name_workers_serve(tmp_path: Path) -> None:
    config = TrainerConfig.model_validate({"lora": {}})
    with pytest.raises(ValueError, match=r"serving\.lora_adapter"):
        await lora_sync(config, ServingConfig(), policy=None, checkpoint_dir=tmp_path, clients=[])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return load_model(str(tiny_model_dir)).model


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return perturbed_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapters"), 1, seed=0)


def _variant(
    adapter_dir: Path, tmp_path: Path, config: dict | None = None, tensors: dict | None = None
) -> str:
    path = tmp_path / "variant"
    shutil.copytree(adapter_dir, path)
    if config is not None:
        original = json.loads((path / ADAPTER_CONFIG).read_text())
        (path / ADAPTER_CONFIG).write_text(json.dumps({**original, **config}))
    if tensors is not None:
        save_file(tensors, path / ADAPTER_WEIGHTS)
    return str(path)


def test_the_engine_reads_peft_scaling(adapter_dir: Path, model: torch.nn.Module, tmp_path: Path) -> None:
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    plain = read_adapter(model, "a", str(adapter_dir))
    assert plain.scaling == config["lora_alpha"] / config["r"]
    assert "model.layers.0.self_attn.q_proj" in plain.layers
    rs = read_adapter(model, "a", _variant(adapter_dir, tmp_path, {"use_rslora": True}))
    assert rs.scaling == pytest.approx(config["lora_alpha"] / math.sqrt(config["r"]))


def test_the_engine_refuses_adapters_it_cannot_serve(
    adapter_dir: Path, model: torch.nn.Module, tmp_path: Path
) -> None:
    tensors = load_file(adapter_dir / ADAPTER_WEIGHTS)
    a_key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    a = tensors[a_key].clone()
    cases = [
        ({"use_dora": True}, None, "use_dora"),
        ({"bias": "all"}, None, "bias"),
        ({"peft_type": "IA3"}, None, "not a LoRA adapter"),
        (None, {**tensors, "base_model.model.model.nowhere.lora_A.weight": a}, "no linear layer"),
        (None, {**tensors, a_key: a[:, :7].contiguous()}, "expected"),
        (None, {k: v for k, v in tensors.items() if k != a_key}, "lacks its lora_A"),
        (None, {**tensors, "base_model.model.lm_head.weight": a}, "unexpected tensor"),
    ]
    for i, (config, weights, message) in enumerate(cases):
        path = _variant(adapter_dir, tmp_path / str(i), config, weights)
        with pytest.raises(AdapterError, match=message):
            read_adapter(model, "a", path)
