"""Our own small implementation of the parts of NVIDIA TensorRT-LLM's `tensorrt_llm.scaffolding` that the
Flywheel integration uses, with the same names and call semantics, for machines without TensorRT-LLM
(which needs CUDA). Import it through `integrations.scaffoldings.api`, which prefers the real module."""

from integrations.scaffoldings.compat.controller import (
    BestOfNController,
    Controller,
    MajorityVoteController,
    NativeGenerationController,
    NativeRewardController,
    ParallelProcess,
)
from integrations.scaffoldings.compat.result import ScaffoldingOutput, ScaffoldingResult
from integrations.scaffoldings.compat.scaffolding_llm import ScaffoldingLlm
from integrations.scaffoldings.compat.task import (
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
from integrations.scaffoldings.compat.worker import Worker

__all__ = [
    "AssistantMessage", "BestOfNController", "ChatTask", "Controller", "GenerationTask",
    "MajorityVoteController", "NativeGenerationController", "NativeRewardController", "ParallelProcess",
    "RoleMessage", "ScaffoldingLlm", "ScaffoldingOutput", "ScaffoldingResult", "StreamGenerationTask",
    "SystemMessage", "Task", "TaskStatus", "UserMessage", "Worker",
]
