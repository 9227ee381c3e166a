"""The one import point of the Scaffolding names: NVIDIA TensorRT-LLM's `tensorrt_llm.scaffolding` when it
is importable, else our own compatible layer (`compat`), so that code importing from here runs unchanged
on either. `SCAFFOLDING_BACKEND` (`auto`, `tensorrt_llm`, `compat`) chooses; `BACKEND` says which won."""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

BACKEND_ENV = "SCAFFOLDING_BACKEND"
TENSORRT_LLM = "tensorrt_llm"
COMPAT = "compat"
BACKENDS = ("auto", TENSORRT_LLM, COMPAT)


def tensorrt_llm_available() -> bool:
    """Whether `tensorrt_llm` is installed (importing it may still fail without CUDA)."""
    return importlib.util.find_spec(TENSORRT_LLM) is not None


def chosen_backend() -> str:
    """`tensorrt_llm` or `compat`, as `SCAFFOLDING_BACKEND` asks (default `auto`: the real one if
    installed). ValueError for an unknown value, or `tensorrt_llm` asked for where it is not installed."""
    wanted = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if wanted not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={wanted!r}: choose one of {', '.join(BACKENDS)}")
    if wanted == TENSORRT_LLM and not tensorrt_llm_available():
        raise ValueError(f"{BACKEND_ENV}={TENSORRT_LLM}, but tensorrt_llm is not installed (it needs CUDA)")
    if wanted == "auto":
        return TENSORRT_LLM if tensorrt_llm_available() else COMPAT
    return wanted


BACKEND = chosen_backend()

if TYPE_CHECKING or BACKEND == COMPAT:
    from integrations.scaffoldings.compat import (
        AssistantMessage,
        BestOfNController,
        ChatTask,
        Controller,
        GenerationTask,
        MajorityVoteController,
        NativeGenerationController,
        NativeRewardController,
        ParallelProcess,
        RoleMessage,
        ScaffoldingLlm,
        ScaffoldingOutput,
        ScaffoldingResult,
        StreamGenerationTask,
        SystemMessage,
        Task,
        TaskStatus,
        UserMessage,
        Worker,
    )
else:
    from tensorrt_llm.scaffolding import (
        BestOfNController,
        Controller,
        MajorityVoteController,
        NativeGenerationController,
        NativeRewardController,
        ParallelProcess,
        ScaffoldingLlm,
        Worker,
    )
    from tensorrt_llm.scaffolding.result import ScaffoldingOutput, ScaffoldingResult
    from tensorrt_llm.scaffolding.task import (
        AssistantMessage,
        ChatTask,
        GenerationTask,
        RoleMessage,
        StreamGenerationTask,
        SystemMessage,
        Task,
        TaskStatus,
        UserMessage,
    )

__all__ = [
    "BACKEND", "AssistantMessage", "BestOfNController", "ChatTask", "Controller", "GenerationTask",
    "MajorityVoteController", "NativeGenerationController", "NativeRewardController", "ParallelProcess",
    "RoleMessage", "ScaffoldingLlm", "ScaffoldingOutput", "ScaffoldingResult", "StreamGenerationTask",
    "SystemMessage", "Task", "TaskStatus", "UserMessage", "Worker",
]
