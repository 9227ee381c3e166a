"""Generating a plan on the workers: `generate` (the whole answer) and `open_stream` (its cumulative
chunks), both surviving lost workers and weight pushes (proxy/workers/resume.py, resume_stream.py)."""

from __future__ import annotations

from typing import Any

from proxy.workers.plan import ChoiceResult, GenerationPlan, read_choice, worker_error
from proxy.workers.resume import generate_outputs
from proxy.workers.resume_stream import ResumingStream
from proxy.workers.routing import Balancer
from serving.errors import WorkerError, WorkerProtocolError


async def generate(balancer: Balancer, plan: GenerationPlan) -> list[ChoiceResult]:
    """Non-streaming generation on the best worker for the plan's session: re-issued on another worker
    when one is lost, and aborted choices (a weight push) resumed as prompt + tokens so far."""
    outputs = await generate_outputs(balancer, plan)
    if len(outputs) != plan.n:
        raise worker_error(WorkerProtocolError(f"asked for {plan.n} samples, got {len(outputs)}"))
    return [read_choice(item, index, final=True) for index, item in enumerate(outputs)]


async def open_stream(balancer: Balancer, plan: GenerationPlan) -> tuple[ResumingStream, dict[str, Any]]:
    """Start a streaming generation: the stream (it holds the worker lease until closed, fails over while
    nothing was generated and resumes choices a weight push aborted or a lost worker cut off; its
    `worker` is the one generating now) and its first chunk."""
    stream = ResumingStream(balancer, plan)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        await stream.aclose()
        raise worker_error(WorkerProtocolError("the stream ended before its first chunk")) from None
    except WorkerError as exc:
        await stream.aclose()
        raise worker_error(exc) from exc
    except BaseException:
        await stream.aclose()
        raise
    return stream, first
