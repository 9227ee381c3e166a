"""SGLang's distributed weight update on the CPU engine, over gloo: `/init_weights_update_group`,
`/begin_weight_update`, `/update_weights_from_distributed`, `/end_weight_update` and
`/destroy_weights_update_group`, answering `{success, message}` as SGLang does (400 on failure).

The engine joins the trainer's group (`serving/weight_group.py`) at its `rank_offset`. For each bucket
the trainer names, it receives the tensors rank 0 broadcasts in a worker thread, never on the event loop
or the decode thread. Unlike SGLang, which loads each bucket as it arrives, it stages a push's buckets and
applies them at once: when the bucket carrying `weight_version` (the trainer's last) has arrived and the
staged tensors cover the whole model, they are copied in between two decode steps, as a disk update is
(`Engine.swap_weights`), and the label changes with them. A push that fails or stops before that leaves
the old weights and the old `weight_version`: what it staged is dropped, at its failure or by the next
`/end_weight_update`, `/begin_weight_update` or `/destroy_weights_update_group`.

A bucket whose names, shapes or dtypes do not fit the model is still received, so that the trainer's
broadcast completes, and then refused, as is every later bucket of that push. A bucket refused before it
is received (no such group, no open session, a dtype torch lacks) leaves the trainer waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import Response

from serving.engine.generate import ServingState
from serving.engine.protocol import MalformedRequest
from serving.engine.replies import error_response, json_object, json_response
from serving.engine.replies import field as body_field
from serving.models.errors import WeightsMismatchError
from serving.models.tensors import check_checkpoint, copy_tensors_strict
from serving.weight_group import TensorMeta, WeightGroup, parse_dtype

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"
"""SGLang's default `group_name`."""
GROUP_TIMEOUT_S = 600.0
"""How long joining a group waits for the other ranks, and a receive for rank 0's tensors (the
trainer's own default). A trainer that fails closes its end of the group, which ends a waiting receive
at once."""
SELECTORS = ("target", "draft", "all")


@dataclass
class _Push:
    """An open weight-update session: the tensors staged so far, or why the push cannot complete."""

    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    failure: str | None = None


@dataclass
class DistributedWeights:
    """The engine's side of distributed updates (one per app): its group and the push in progress. Every
    route holds `lock`, so a receive and whatever follows it never interleave."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    group: WeightGroup | None = None
    push: _Push | None = None


def _weights(request: Request) -> DistributedWeights:
    """The app's `DistributedWeights`, made on first use (on the event loop, like every route)."""
    state = request.app.state
    weights = getattr(state, "distributed_weights", None)
    if weights is None:
        weights = state.distributed_weights = DistributedWeights()
    return weights


def _answer(success: bool, message: str) -> Response:
    return json_response({"success": success, "message": message}, 200 if success else 400)


async def init_weights_update_group(request: Request) -> Response:
    """Join the trainer's group (returns once every rank has joined); gloo only, one group at a time."""
    try:
        body = await json_object(request)
        address = body_field(body, "master_address", str, required=True)
        port = body_field(body, "master_port", int, required=True)
        rank = body_field(body, "rank_offset", int, required=True)
        world_size = body_field(body, "world_size", int, required=True)
        name = body_field(body, "group_name", str, DEFAULT_GROUP)
        backend = body_field(body, "backend", str, "nccl")
    except MalformedRequest as exc:
        return error_response(exc)
    if backend != "gloo":
        return _answer(False, f"Failed to initialize custom process group: the CPU engine joins over gloo, "
                              f"not {backend}.")
    weights = _weights(request)
    async with weights.lock:
        if weights.group is not None:
            return _answer(False, f"Failed to initialize custom process group: already in group "
                                  f"{weights.group.name!r}; destroy it first.")
        try:
            weights.group = await asyncio.to_thread(
                WeightGroup.join, address, port, rank, world_size, name, backend, GROUP_TIMEOUT_S
            )
        except Exception as exc:  # a refused rendezvous, a timeout, a bad rank: the caller's to read
            logger.warning("joining weight-update group %s failed: %s", name, exc)
            return _answer(False, f"Failed to initialize custom process group: {exc}.")
    return _answer(True, "Succeeded to initialize custom process group.")


async def destroy_weights_update_group(request: Request) -> Response:
    """Leave the group; a push in progress is dropped."""
    try:
        name = body_field(await json_object(request, empty_ok=True), "group_name", str, DEFAULT_GROUP)
    except MalformedRequest as exc:
        return error_response(exc)
    weights = _weights(request)
    async with weights.lock:
        group = weights.group
        if group is None or group.name != name:
            return _answer(False, "The group to be destroyed does not exist.")
        weights.group = None
        _drop(weights, "the weight-update group was destroyed")
        await asyncio.to_thread(group.destroy)
    return _answer(True, "Succeeded to destroy custom process group.")


async def begin_weight_update(request: Request) -> Response:
    """Open a weight-update session (one at a time, as SGLang)."""
    try:
        selector = body_field(await json_object(request, empty_ok=True), "selector", str, "all")
        if selector not in SELECTORS:
            raise MalformedRequest(f"selector: Input should be 'target', 'draft' or 'all', got {selector!r}")
    except MalformedRequest as exc:
        return error_response(exc)
    weights = _weights(request)
    async with weights.lock:
        if weights.push is not None:
            return _answer(False, "a weight-update session is already open; call end_weight_update() first")
        weights.push = _Push()
    return _answer(True, "Success")


async def end_weight_update(request: Request) -> Response:
    """Close the session; tensors staged without the bucket that completes them are dropped."""
    try:
        await json_object(request, empty_ok=True)
    except MalformedRequest as exc:
        return error_response(exc)
    weights = _weights(request)
    async with weights.lock:
        push = weights.push
        if push is None:
            return _answer(False, "no weight-update session is open; call begin_weight_update() first")
        weights.push = None
    if push.staged:
        logger.warning("weight update ended incomplete: %d staged tensors dropped", len(push.staged))
        return _answer(True, f"Success. Dropped {len(push.staged)} tensors of an incomplete update.")
    return _answer(True, "Success")


async def update_weights_from_distributed(request: Request) -> Response:
    """Receive one bucket; the bucket carrying `weight_version` applies the whole push."""
    try:
        body = await json_object(request)
        metas = _bucket(body)
        name = body_field(body, "group_name", str, DEFAULT_GROUP)
        version = body_field(body, "weight_version", str)
        abort_all = body_field(body, "abort_all_requests", bool, False)
        body_field(body, "flush_cache", bool)  # no prefix cache here: nothing to flush
        body_field(body, "torch_empty_cache", bool)
        body_field(body, "selector", str)
        load_format = body_field(body, "load_format", str)
    except MalformedRequest as exc:
        return error_response(exc)
    state: ServingState = request.app.state.serving
    weights = _weights(request)
    async with weights.lock:
        refusal = _refusal_before_receiving(weights, name, load_format, metas)
        if refusal is not None:
            return _answer(False, refusal)
        group, push = weights.group, weights.push
        assert group is not None and push is not None
        model = state.engine.model
        misfit = _misfit(model, metas, push.staged)
        try:  # received even when it does not fit: the trainer's broadcast must complete
            tensors = await asyncio.to_thread(_receive, group, metas, model)
        except Exception as exc:
            _fail(push, f"Failed to receive weights: {exc}")
        else:
            if push.failure is None and misfit is not None:
                _fail(push, misfit)
            if push.failure is None:
                push.staged.update(zip((meta.name for meta in metas), tensors, strict=True))
        if push.failure is not None:
            state.engine.metrics.weight_updates.labels("failure").inc()
            return _answer(False, push.failure)
        if version is None:
            return _answer(True, f"Received {len(metas)} tensors; {len(push.staged)} staged until the bucket "
                                 f"that carries weight_version.")
        staged, push.staged = push.staged, {}
        return await _apply(state, staged, version, abort_all)


async def _apply(state: ServingState, staged: dict[str, torch.Tensor], version: str,
                 abort_all: bool) -> Response:
    """Swap the completed push in between two steps (as a disk update), or refuse it whole."""
    shapes = {name: tuple(tensor.shape) for name, tensor in staged.items()}
    try:
        check_checkpoint(state.engine.model, shapes, source="the distributed update")  # type: ignore[arg-type]
    except WeightsMismatchError as exc:
        state.engine.metrics.weight_updates.labels("failure").inc()
        return _answer(False, f"Failed to update parameter online: {exc}")

    def load(model: torch.nn.Module) -> None:
        copy_tensors_strict(model, staged, "the distributed update")  # type: ignore[arg-type]
    async with state.update_lock:
        result = await state.engine.swap_weights(load, version, abort_all)
    if not result.success:
        return _answer(False, result.message)
    logger.info("distributed update of %d tensors applied as version %s", len(staged), version)
    return _answer(True, f"Succeeded to update parameter online. Weight version updated to {version}.")


def _bucket(body: dict[str, Any]) -> list[TensorMeta]:
    """The bucket's tensors from `names`, `dtypes` and `shapes` (MalformedRequest when they do not line
    up)."""
    names = body_field(body, "names", list, required=True)
    dtypes = body_field(body, "dtypes", list, required=True)
    shapes = body_field(body, "shapes", list, required=True)
    if not len(names) == len(dtypes) == len(shapes):
        raise MalformedRequest(f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, "
                               f"{len(shapes)}")
    if not all(isinstance(value, str) for value in (*names, *dtypes)):
        raise MalformedRequest("names and dtypes: Input should be a list of strings")
    if not all(isinstance(shape, list) and all(_is_size(size) for size in shape) for shape in shapes):
        raise MalformedRequest("shapes: Input should be a list of lists of non-negative integers")
    return [TensorMeta(n, d, tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _refusal_before_receiving(weights: DistributedWeights, name: str, load_format: str | None,
                              metas: Sequence[TensorMeta]) -> str | None:
    """Why the bucket cannot even be received, or None."""
    if weights.group is None or weights.group.name != name:
        return f"Failed to receive weights: not in a weight-update group named {name!r}."
    if weights.push is None:
        return ("update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()")
    if load_format is not None:
        return f"Failed to receive weights: load_format {load_format!r} is not supported by the CPU engine."
    for meta in metas:
        try:
            parse_dtype(meta.dtype)
        except ValueError as exc:
            return f"Failed to receive weights: {meta.name}: {exc}."
    return None


def _misfit(model: torch.nn.Module, metas: Sequence[TensorMeta],
            staged: dict[str, torch.Tensor]) -> str | None:
    """Why the bucket does not fit the model (an unknown name, a wrong shape, a non-float dtype, a name
    sent twice in one push), or None."""
    targets = model.state_dict(keep_vars=True)
    seen: set[str] = set(staged)
    for meta in metas:
        target = targets.get(meta.name)
        if target is None:
            problem = "is not a tensor of the model"
        elif tuple(target.shape) != meta.shape:
            problem = f"has shape {list(meta.shape)}, the model's is {list(target.shape)}"
        elif not parse_dtype(meta.dtype).is_floating_point:
            problem = f"has dtype {meta.dtype}, not a floating-point one"
        elif meta.name in seen:
            problem = "was sent twice in one update"
        else:
            seen.add(meta.name)
            continue
        return f"Failed to update parameter online: tensor {meta.name} {problem}; nothing was loaded."
    return None


def _receive(group: WeightGroup, metas: Sequence[TensorMeta], model: torch.nn.Module) -> list[torch.Tensor]:
    """The bucket's tensors from rank 0, each in its model tensor's dtype where the model has it."""
    targets = model.state_dict(keep_vars=True)
    received = group.receive(metas)
    return [tensor.to(targets[meta.name].dtype) if meta.name in targets else tensor
            for meta, tensor in zip(metas, received, strict=True)]


def _fail(push: _Push, reason: str) -> None:
    """The push cannot complete any more: drop what it staged and remember why."""
    if push.failure is None:
        logger.warning("distributed weight update refused: %s", reason)
        push.failure = reason
    push.staged.clear()


def _drop(weights: DistributedWeights, reason: str) -> None:
    if weights.push is not None:
        _fail(weights.push, reason)
