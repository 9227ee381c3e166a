"""Model resolution, the conversion cache, and strict in-place weight loading, on the tiny model."""

from __future__ import annotations

import copy
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from serving.models import paths
from serving.models.loading import (
    LoadedModel,
    WeightsMismatchError,
    load_model,
    load_tokenizer,
    load_weights_into,
)
from serving.models.paths import (
    ModelLoadError,
    ModelNotFoundError,
    build_once,
    default_cache_dir,
    gguf_cache_name,
    resolve_model_dir,
)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _plain_state(model) -> dict[str, torch.Tensor]:
    """The state dict as separate tensors, tied duplicates dropped (as save_pretrained writes it)."""
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.fixture
def tiny(tiny_model_dir: Path, tmp_path: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), cache_dir=tmp_path)


PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250]])


def test_default_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("FLYWHEEL_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "flywheel"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "flywheel"
    monkeypatch.setenv("FLYWHEEL_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"


def test_local_directory_loads_as_itself(tiny: LoadedModel, tiny_model_dir: Path) -> None:
    assert tiny.model_dir == tiny_model_dir
    assert tiny.name == str(tiny_model_dir)
    assert not tiny.model.training
    assert tiny.model.dtype == torch.float32
    assert tiny.tokenizer.eos_token == "<|im_end|>"
    assert tiny.tokenizer.chat_template
    assert _logits(tiny.model, PROMPT).shape == (1, PROMPT.shape[1], len(tiny.tokenizer))


def test_dtype_is_applied_and_checked(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert load_model(str(tiny_model_dir), dtype="bfloat16", cache_dir=tmp_path).model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float32"):
        load_model(str(tiny_model_dir), dtype="int8", cache_dir=tmp_path)


def test_tiny_builds_into_cache_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_model("tiny", cache_dir=tmp_path)
    assert first.model_dir == tmp_path / "models" / "tiny-seed0"
    weights = first.model_dir / "model.safetensors"
    built_at = weights.stat().st_mtime_ns

    def must_not_rebuild(out_dir: Path) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(paths, "_build_tiny", must_not_rebuild)
    second = load_model("tiny", cache_dir=tmp_path)
    assert second.model_dir == first.model_dir
    assert weights.stat().st_mtime_ns == built_at
    assert torch.equal(_logits(first.model, PROMPT), _logits(second.model, PROMPT))
    assert load_tokenizer(second.model_dir).get_vocab() == first.tokenizer.get_vocab()


def test_interrupted_build_is_not_a_cache(tmp_path: Path) -> None:
    models = tmp_path / "models"
    leftover = models / ".tiny-seed0.tmp-crashed"  # what a build killed before its rename leaves
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")

    model_dir = resolve_model_dir("tiny", tmp_path)
    assert model_dir == models / "tiny-seed0"
    assert (model_dir / "model.safetensors").is_file()
    assert not leftover.exists()
    assert not [p for p in models.iterdir() if ".tmp-" in p.name]
    load_model("tiny", cache_dir=tmp_path)


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def broken(out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_once(tmp_path / "m", broken)
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    calls: list[int] = []
    results: list[Path] = []

    def slow_build(out_dir: Path) -> None:
        calls.append(threading.get_ident())
        time.sleep(0.3)
        (out_dir / "config.json").write_text("{}")

    def build() -> None:
        results.append(build_once(tmp_path / "m", slow_build))

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [tmp_path / "m"] * 4
    assert (tmp_path / "m" / "config.json").is_file()


@pytest.mark.parametrize("max_shard_size", [None, "1MB"], ids=["one-file", "sharded"])
def test_load_weights_into_round_trips(tiny: LoadedModel, tmp_path: Path, max_shard_size: str | None) -> None:
    torch.manual_seed(1)
    perturbed = copy.deepcopy(tiny.model)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    checkpoint = tmp_path / "step-1"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    perturbed.save_pretrained(checkpoint, **kwargs)
    assert (checkpoint / "model.safetensors.index.json").is_file() == bool(max_shard_size)

    before = _logits(tiny.model, PROMPT)
    expected = _logits(perturbed, PROMPT)
    assert not torch.allclose(before, expected)
    load_weights_into(tiny.model, checkpoint)
    assert torch.equal(_logits(tiny.model, PROMPT), expected)
    # Tied weights stay tied: the embedding loaded also serves as the output layer.
    assert tiny.model.lm_head.weight is tiny.model.model.embed_tokens.weight


def test_load_weights_into_rejects_wrong_shape(tiny: LoadedModel, tmp_path: Path) -> None:
    state = _plain_state(tiny.model)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(7, 3)
    state["model.norm.weight"] = state["model.norm.weight"] + 1  # a valid tensor that must not be copied
    save_file(state, tmp_path / "model.safetensors")
    before = _logits(tiny.model, PROMPT)

    with pytest.raises(WeightsMismatchError, match=r"wrong shape: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights_into(tiny.model, tmp_path)
    assert torch.equal(_logits(tiny.model, PROMPT), before)


def test_load_weights_into_rejects_missing_and_unexpected(tiny: LoadedModel, tmp_path: Path) -> None:
    state = _plain_state(tiny.model)
    del state["model.layers.0.self_attn.q_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightsMismatchError, match=r"1 missing: model\.layers\.0\.self_attn\.q_proj\.weight"):
        load_weights_into(tiny.model, tmp_path)

    state = _plain_state(tiny.model)
    state["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightsMismatchError, match=r"1 unexpected: model\.layers\.9\.extra\.weight"):
        load_weights_into(tiny.model, tmp_path)


def test_load_weights_into_needs_a_checkpoint(tiny: LoadedModel, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="No safetensors checkpoint"):
        load_weights_into(tiny.model, tmp_path)


def test_hub_id_offline_fails_with_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as caught:
        load_model("flywheel-tests/no-such-model", cache_dir=tmp_path)
    message = str(caught.value)
    assert "'flywheel-tests/no-such-model'" in message
    assert "HF_HUB_OFFLINE" in message
    assert "local directory" in message


def test_paths_that_are_not_models(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="no such path"):
        resolve_model_dir(str(tmp_path / "absent"), tmp_path)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "absent.gguf"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model_dir(str(tmp_path / "empty"), tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        resolve_model_dir(str(tmp_path / "notes.txt"), tmp_path)


def test_gguf_cache_name_follows_the_file(tmp_path: Path) -> None:
    gguf = tmp_path / "My Model.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    name = gguf_cache_name(gguf)
    assert name.startswith("my-model.q4_k_m-")
    assert gguf_cache_name(gguf) == name
    assert gguf_cache_name(gguf, prefix="demo-x").startswith("demo-x-")
    os.utime(gguf, ns=(1, 1))
    assert gguf_cache_name(gguf) != name
