"""The CPU engine's FastAPI app: SGLang 0.5.23's native routes over one `Engine`.

Everything stateful (the engine, its decode thread, metrics) is built in the lifespan and hung on
`app.state.serving`; nothing lives at module level.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.metadata
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from serving.config import ServingConfig
from serving.engine.distributed_weights import (
    begin_weight_update,
    destroy_weights_update_group,
    end_weight_update,
    init_weights_update_group,
    update_weights_from_distributed,
)
from serving.engine.generate import ServingState, generate, health_generate
from serving.engine.grammar import GrammarCache
from serving.engine.lora import load_lora_adapter, unload_lora_adapter
from serving.engine.metrics import EngineMetrics
from serving.engine.protocol import MalformedRequest
from serving.engine.replies import error_response, field, json_object, json_response
from serving.engine.scheduler import Engine
from serving.engine.weights import CheckpointError, read_checkpoint
from serving.models.loading import LoadedModel
from serving.models.tensors import copy_tensors_strict

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


def create_engine_app(config: ServingConfig, loaded_model: LoadedModel, *, host: str = "", port: int = 0,
                      worker_index: int = 0) -> FastAPI:
    """An app serving `loaded_model` with `config.cpu`'s engine settings (the engine starts with the app)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threads_before = torch.get_num_threads()
        if config.cpu.num_threads is not None:  # process-wide in torch: restored when the app stops
            torch.set_num_threads(config.cpu.num_threads)
        app.state.serving = _build_state(config, loaded_model, host, port, worker_index)
        app.state.serving.engine.start(asyncio.get_running_loop())
        logger.info("CPU engine %d serving %s (context %d, max batch %d, %d torch threads)", worker_index,
                    loaded_model.name, app.state.serving.context_length, config.cpu.max_batch_size,
                    torch.get_num_threads())
        try:
            yield
        finally:
            await asyncio.to_thread(app.state.serving.engine.stop)
            torch.set_num_threads(threads_before)

    app = FastAPI(title="Flywheel CPU engine", lifespan=lifespan)
    app.add_api_route("/generate", generate, methods=["POST", "PUT"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health_generate", health_generate, methods=["GET"])
    app.add_api_route("/model_info", model_info, methods=["GET"])
    app.add_api_route("/get_model_info", model_info, methods=["GET"])
    app.add_api_route("/server_info", server_info, methods=["GET"])
    app.add_api_route("/get_server_info", server_info, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"])
    app.add_api_route("/update_weight_version", update_weight_version, methods=["POST"])
    app.add_api_route("/init_weights_update_group", init_weights_update_group, methods=["POST"])
    app.add_api_route("/begin_weight_update", begin_weight_update, methods=["POST"])
    app.add_api_route("/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"])
    app.add_api_route("/end_weight_update", end_weight_update, methods=["POST"])
    app.add_api_route("/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"])
    app.add_api_route("/load_lora_adapter", load_lora_adapter, methods=["POST"])
    app.add_api_route("/unload_lora_adapter", unload_lora_adapter, methods=["POST"])
    app.add_api_route("/pause_generation", pause_generation, methods=["POST"])
    app.add_api_route("/continue_generation", continue_generation, methods=["POST"])
    app.add_api_route("/abort_request", abort_request, methods=["POST"])
    app.add_api_route("/flush_cache", flush_cache, methods=["GET", "POST"])
    return app


def _build_state(config: ServingConfig, loaded: LoadedModel, host: str, port: int,
                 worker_index: int) -> ServingState:
    cpu = config.cpu
    model = loaded.model.eval()
    model_config = model.config
    context = cpu.context_length or getattr(model_config, "max_position_embeddings", None) \
        or loaded.tokenizer.model_max_length
    engine = Engine(model, copy.deepcopy(loaded.tokenizer), max_batch_size=cpu.max_batch_size,
                    metrics=EngineMetrics())
    vocab_size = model.get_input_embeddings().weight.shape[0]
    eos_token_ids = _eos_token_ids(model, loaded.tokenizer)
    # Grammars compile in worker threads: they read a tokenizer of their own.
    grammars = GrammarCache(copy.deepcopy(loaded.tokenizer), vocab_size, eos_token_ids)
    return ServingState(
        engine=engine, tokenizer=loaded.tokenizer, model_path=str(loaded.model_dir),
        tokenizer_path=str(loaded.model_dir), served_model_name=config.served_model_name or loaded.name,
        context_length=int(context), vocab_size=vocab_size, eos_token_ids=eos_token_ids,
        default_max_new_tokens=cpu.default_max_new_tokens, max_batch_size=cpu.max_batch_size,
        host=host, port=port, worker_index=worker_index, update_lock=asyncio.Lock(), grammars=grammars,
    )


def _eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the model config, its generation config and the tokenizer (SGLang's union)."""
    ids: set[int] = set()
    sources = [getattr(model, "config", None), getattr(model, "generation_config", None)]
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _state(request: Request) -> ServingState:
    return request.app.state.serving


async def health(request: Request) -> Response:
    return Response(status_code=200)


async def model_info(request: Request) -> Response:
    state = _state(request)
    config = state.engine.model.config
    return json_response({
        "model_path": state.model_path, "served_model_name": state.served_model_name,
        "tokenizer_path": state.tokenizer_path, "is_generation": True, "preferred_sampling_params": None,
        "weight_version": state.engine.weight_version, "load_format": "auto", "reasoning_parser": None,
        "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": getattr(config, "model_type", None),
        "architectures": getattr(config, "architectures", None),
    })


async def server_info(request: Request) -> Response:
    state = _state(request)
    internal = {**state.engine.metrics.snapshot(), "paused": state.engine.paused,
                "weight_version": state.engine.weight_version}
    return json_response({
        "model_path": state.model_path, "served_model_name": state.served_model_name,
        "tokenizer_path": state.tokenizer_path, "max_context_length": state.context_length,
        "max_running_requests": state.max_batch_size, "version": _version(), "engine": "flywheel-cpu",
        "internal_states": [internal], "host": state.host, "port": state.port,
        "worker_index": state.worker_index, "incremental_streaming_output": False,
        "disaggregation_mode": "null",
    })


def _version() -> str:
    try:
        return importlib.metadata.version("flywheel-rl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


async def metrics(request: Request) -> Response:
    registry = _state(request).engine.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def update_weights_from_disk(request: Request) -> Response:
    """Read the checkpoint off the decode thread, then swap it in between two steps (or fail cleanly)."""
    state = _state(request)
    try:
        body = await json_object(request)
        model_path = field(body, "model_path", str, required=True)
        version = field(body, "weight_version", str)
        abort_all = field(body, "abort_all_requests", bool, False)
        field(body, "flush_cache", bool)  # no prefix cache here: nothing to flush
        field(body, "load_format", str)
    except MalformedRequest as exc:
        return error_response(exc)
    async with state.update_lock:
        try:
            tensors = await asyncio.to_thread(read_checkpoint, state.engine.model, model_path)
        except CheckpointError as exc:
            state.engine.metrics.weight_updates.labels("failure").inc()
            logger.warning("weight update from %s refused: %s", model_path, exc)
            return json_response({"success": False, "message": f"Failed to get weights iterator: {exc}.",
                                  "num_paused_requests": 0}, 400)

        def load(model: torch.nn.Module) -> None:
            copy_tensors_strict(model, tensors, model_path)  # type: ignore[arg-type]
        result = await state.engine.swap_weights(load, version, abort_all)
        if result.success:
            state.model_path = model_path
    return json_response({"success": result.success, "message": result.message,
                          "num_paused_requests": result.num_paused_requests}, 200 if result.success else 400)


async def update_weight_version(request: Request) -> Response:
    state = _state(request)
    try:
        body = await json_object(request)
        version = field(body, "new_version", str, required=True)
        abort_all = field(body, "abort_all_requests", bool, True)
    except MalformedRequest as exc:
        return error_response(exc)
    await state.engine.set_weight_version(version, abort_all)
    return json_response({"success": True, "message": f"Weight version updated to {version}",
                          "new_version": version})


async def pause_generation(request: Request) -> Response:
    try:
        mode = field(await json_object(request, empty_ok=True), "mode", str, "abort")
        if mode not in PAUSE_MODES:
            raise MalformedRequest(f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}")
    except MalformedRequest as exc:
        return error_response(exc)
    await _state(request).engine.pause(mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: Request) -> Response:
    try:
        await json_object(request, empty_ok=True)
    except MalformedRequest as exc:
        return error_response(exc)
    await _state(request).engine.resume()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: Request) -> Response:
    try:
        body = await json_object(request, empty_ok=True)
        rid = field(body, "rid", str, "")
        abort_all = field(body, "abort_all", bool, False)
    except MalformedRequest as exc:
        return error_response(exc)
    _state(request).engine.abort(rid=rid, abort_all=abort_all)
    return Response(status_code=200)


async def flush_cache(request: Request) -> Response:
    """No prefix cache to drop here, but refused while requests run or wait, as SGLang refuses it."""
    engine = _state(request).engine
    queues = engine.metrics.snapshot()
    if queues["running_requests"] or (queues["waiting_requests"] and not engine.paused):
        return PlainTextResponse("Flush cache failed.\n", status_code=400)
    return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                             "(When there are running or waiting requests, the operation will not be "
                             "performed.)\n")
