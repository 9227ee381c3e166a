"""Shared fixtures: the tiny test model and sglang 0.5.23's own wire schema."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

# Ray 2.60 writes an auth token under ~/.ray unless told otherwise; tests never want that.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~1M-parameter Qwen2-style model with a local BPE tokenizer and a ChatML+tools template."""
    from serving.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def sglang_api_types() -> ModuleType:
    """sglang 0.5.23's `api_types.py`, loaded by path (it needs only msgspec)."""
    from tests.support.sglang_schema import load_api_types

    try:
        return load_api_types()
    except Exception as exc:  # the wheel may be unreachable; say why and skip
        pytest.skip(f"sglang 0.5.23 wheel could not be downloaded: {exc}")
