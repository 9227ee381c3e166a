"""Checkpoints: a full model directory the loaders accept, written atomically, pruned to the newest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from serving.models.loading import load_model, load_weights_into
from trainer.checkpoint import (
    checkpoint_name,
    list_checkpoints,
    load_trainer_state,
    prune_checkpoints,
    save_checkpoint,
)


@pytest.fixture
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return load_model(str(tiny_model_dir)).model


def _perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)


def test_checkpoint_is_a_full_model_directory_that_loads_back(
    model: torch.nn.Module, tiny_model_dir: Path, tmp_path: Path
) -> None:
    _perturb(model, seed=1)
    path = save_checkpoint(model, tiny_model_dir, tmp_path / "ckpt", version=7)
    assert path == tmp_path / "ckpt" / "v000007"
    files = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= files
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is True
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["v000007"]  # no temporary left behind

    served = load_model(str(tiny_model_dir))  # what an engine holds: the original weights
    load_weights_into(served.model, path)  # strict: names and shapes must match exactly
    reloaded = load_model(str(path))  # and transformers reads it as a model of its own
    for name, tensor in model.state_dict().items():
        assert torch.equal(served.model.state_dict()[name], tensor), name
        assert torch.equal(reloaded.model.state_dict()[name], tensor), name


def test_saving_a_version_again_replaces_the_leftover(
    model: torch.nn.Module, tiny_model_dir: Path, tmp_path: Path
) -> None:
    first = save_checkpoint(model, tiny_model_dir, tmp_path, version=1)
    _perturb(model, seed=2)
    second = save_checkpoint(model, tiny_model_dir, tmp_path, version=1)
    assert first == second
    fresh = load_model(str(tiny_model_dir)).model
    load_weights_into(fresh, second)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_trainer_state_travels_inside_the_checkpoint(
    model: torch.nn.Module, tiny_model_dir: Path, tmp_path: Path
) -> None:
    plain = save_checkpoint(model, tiny_model_dir, tmp_path, version=1)
    assert load_trainer_state(plain) is None
    state = {"optimizer": {"step": torch.tensor(3.0)}, "baselines": {"means": {"*": 0.5}, "counts": {"*": 2}}}
    path = save_checkpoint(model, tiny_model_dir, tmp_path, version=2, state=state)
    loaded = load_trainer_state(path)
    assert loaded is not None and loaded["baselines"] == state["baselines"]
    assert torch.equal(loaded["optimizer"]["step"], torch.tensor(3.0))
    assert not list(path.glob("*.pt"))  # no loader mistakes it for weights
    load_weights_into(load_model(str(tiny_model_dir)).model, path)


def test_prune_keeps_the_newest_and_the_protected(tmp_path: Path) -> None:
    for version in range(1, 6):
        (tmp_path / checkpoint_name(version)).mkdir()
    (tmp_path / ".v000006.tmp-abcd").mkdir()  # an interrupted save
    removed = prune_checkpoints(tmp_path, keep=2, protect={1, 3})  # say the best and the served
    assert sorted(p.name for p in removed) == ["v000002"]
    assert list(list_checkpoints(tmp_path)) == [1, 3, 4, 5]
    assert not (tmp_path / ".v000006.tmp-abcd").exists()
    assert prune_checkpoints(tmp_path, keep=None, protect={5}) == []
