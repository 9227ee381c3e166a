"""The weight-update calls of SGLang's admin API, a part of `SGLangClient` (serving/client.py) kept apart:
loading a checkpoint from disk, relabelling the version, LoRA adapters, and the distributed weight-update
group (`/init_weights_update_group`, `/update_weights_from_distributed` inside `/begin_weight_update` …
`/end_weight_update`). None of them is resent after a dropped connection: the worker may have run it.
"""

from __future__ import annotations

from typing import Any


class WeightUpdateCalls:
    """Mixed into `SGLangClient`, which provides `_admin_json` (a POST with the admin key, answered by a
    JSON object)."""

    async def _admin_json(self, path: str, body: dict[str, Any], *, idempotent: bool) -> dict[str, Any]:
        raise NotImplementedError

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | str | None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Load new weights from a checkpoint directory; answers `{success, message, num_paused_requests}`.

        SGLang waits for in-flight requests first unless generation is paused or
        `abort_all_requests` is true. A failed load is an HTTP 400 (WorkerBadRequest).
        """
        body: dict[str, Any] = {
            "model_path": model_path,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return await self._admin_json("/update_weights_from_disk", body, idempotent=False)

    async def update_weight_version(
        self, version: int | str, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Relabel the weights served: later answers report `version` as their `weight_version`. Nothing
        is loaded (a LoRA push loads its adapter first). SGLang's own default aborts every request."""
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return await self._admin_json("/update_weight_version", body, idempotent=True)

    async def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        """Load the peft adapter directory `lora_path` as `lora_name` (SGLang needs `--enable-lora`);
        requests then name it with `lora_path: lora_name`. Answers `{success, error_message,
        loaded_adapters}`; a refusal (unreadable adapter, a name already loaded) is a 400
        (WorkerBadRequest)."""
        body = {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}
        return await self._admin_json("/load_lora_adapter", body, idempotent=False)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload adapter `lora_name` (SGLang first lets the requests using it finish). A name that is not
        loaded is a 400 (WorkerBadRequest) whose message says it `does not exist`."""
        return await self._admin_json("/unload_lora_adapter", {"lora_name": lora_name}, idempotent=False)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> dict[str, Any]:
        """Join the weight-update process group whose rank 0 (the trainer) hosts its store at
        `master_address:master_port`, at ranks from `rank_offset`; answers `{success, message}` once every
        rank has joined. A refusal is a 400 (WorkerBadRequest)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._admin_json("/init_weights_update_group", body, idempotent=False)

    async def begin_weight_update(self) -> dict[str, Any]:
        """Open a weight-update session; SGLang takes `/update_weights_from_distributed` only inside one."""
        return await self._admin_json("/begin_weight_update", {}, idempotent=False)

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Receive the tensors `names` (with those dtypes and shapes) that rank 0 of `group_name` broadcasts
        meanwhile, in that order; `weight_version` relabels the weights with them. Answers `{success,
        message}` once they are received; a refusal is a 400 (WorkerBadRequest)."""
        body: dict[str, Any] = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._admin_json("/update_weights_from_distributed", body, idempotent=False)

    async def end_weight_update(self) -> dict[str, Any]:
        """Close the weight-update session (400 when none is open)."""
        return await self._admin_json("/end_weight_update", {}, idempotent=False)

    async def destroy_weights_update_group(self, group_name: str) -> dict[str, Any]:
        """Leave the weight-update group `group_name` (400 when the worker is in none of that name)."""
        body = {"group_name": group_name}
        return await self._admin_json("/destroy_weights_update_group", body, idempotent=False)
