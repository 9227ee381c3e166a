"""SGLang's dynamic LoRA routes on the CPU engine: `/load_lora_adapter` and `/unload_lora_adapter`.

A loaded adapter (`serving/engine/adapters.py`) is read and checked off the decode thread, its layers are
hooked between two decode steps, and then requests may name it (`lora_path` in `/generate`). Unloading
only forgets the name: a sequence keeps the adapter it was admitted with until it ends, as SGLang lets
the requests using an adapter finish before it unloads it. Both answer as SGLang does: `{success,
error_message, loaded_adapters}`, HTTP 400 on a refusal. LoRA needs no start-up flag here (SGLang's
`--enable-lora`), and `pinned` is accepted and has no effect (nothing is ever evicted).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import Response

from serving.engine.adapters import AdapterError, read_adapter
from serving.engine.generate import ServingState
from serving.engine.protocol import MalformedRequest
from serving.engine.replies import error_response, field, json_object, json_response

logger = logging.getLogger(__name__)


async def load_lora_adapter(request: Request) -> Response:
    """Load a peft adapter directory under a name no loaded adapter has."""
    state: ServingState = request.app.state.serving
    try:
        body = await json_object(request)
        name = field(body, "lora_name", str, required=True)
        path = field(body, "lora_path", str, required=True)
        field(body, "pinned", bool, False)
    except MalformedRequest as exc:
        return error_response(exc)
    async with state.update_lock:  # one adapter or weight change at a time
        if name in state.loras:
            return _answer(state, f"Failed to load LoRA adapter {name} because it is already loaded")
        try:
            adapter = await asyncio.to_thread(read_adapter, state.engine.model, name, path)
        except AdapterError as exc:
            logger.warning("LoRA adapter %s refused: %s", name, exc)
            return _answer(state, str(exc))
        await state.engine.install_adapter(adapter)
        state.loras[name] = adapter
    logger.info("loaded LoRA adapter %s from %s (%d layers)", name, path, len(adapter.layers))
    return _answer(state)


async def unload_lora_adapter(request: Request) -> Response:
    """Forget an adapter's name: later requests naming it are refused."""
    state: ServingState = request.app.state.serving
    try:
        name = field(await json_object(request), "lora_name", str, required=True)
    except MalformedRequest as exc:
        return error_response(exc)
    async with state.update_lock:
        if state.loras.pop(name, None) is None:
            loaded = sorted(state.loras)
            return _answer(state, f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}")
    logger.info("unloaded LoRA adapter %s", name)
    return _answer(state)


def _answer(state: ServingState, error: str | None = None) -> Response:
    """SGLang's LoRAUpdateOutput: success, the error message ("" on success), the adapters loaded now."""
    loaded = {name: adapter.path for name, adapter in state.loras.items()}
    body = {"success": error is None, "error_message": error or "", "loaded_adapters": loaded}
    return json_response(body, 200 if error is None else 400)
