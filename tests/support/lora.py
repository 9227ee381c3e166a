"""LoRA helpers for tests: an adapter checkpoint that changes the model, the trainer's own check of a
generation's logprobs, a worker client that names an adapter in every request (as the proxy does with
`serving.lora_adapter`), and a proxy configured so."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec
import numpy as np
import torch

from proxy.auth import create_admin_key
from proxy.config import ProxyConfig
from proxy.server import serve_proxy_in_thread
from serving.client import GenerateInput, GenerateOutput, SGLangClient
from serving.config import ClientConfig, ServingConfig
from serving.models.loading import load_model
from storage.records import TrainingSample
from tests.support.databases import key_hasher, storage_config
from tests.support.proxy_harness import Proxy, new_session_key, run_db
from trainer.checkpoint import save_adapter_checkpoint
from trainer.config import LoraConfig
from trainer.lora import adapter_config, adapter_tensors, with_lora
from trainer.policy import Policy


def perturbed_adapter(model_dir: Path, checkpoint_dir: Path, version: int, seed: int) -> Path:
    """An adapter checkpoint as the trainer writes it, with B drawn at random (peft starts B at 0, which
    changes nothing), so that it moves the model's logprobs well beyond any tolerance."""
    torch.manual_seed(seed)
    model = with_lora(load_model(str(model_dir)).model, LoraConfig())
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.1)
    return save_adapter_checkpoint(adapter_tensors(model), adapter_config(model), checkpoint_dir, version)


def recomputation_gap(
    policy: Policy, prompt_ids: Sequence[int], output_ids: Sequence[int], logprobs: Sequence[float]
) -> float:
    """The largest difference between a generation's logprobs (sampled at T = 1) and the trainer's
    recomputation of them: `prox_behave/max_abs_diff` of a train step on it (one sample, so its
    advantage and its update are zero)."""
    prompt_len = len(prompt_ids)
    sample = TrainingSample(
        trajectory_id=0,
        token_ids=np.array([*prompt_ids, *output_ids]),
        loss_mask=np.array([False] * prompt_len + [True] * len(output_ids)),
        logprobs=np.array([0.0] * prompt_len + list(logprobs), dtype=np.float32),
        versions=np.array([-1] * prompt_len + [0] * len(output_ids)),
        reward=0.0,
        group_id="g",
    )
    return policy.train_step([sample], 0)["prox_behave/max_abs_diff"]


class AdapterClient(SGLangClient):
    """A worker client whose every `/generate` names the LoRA adapter `adapter` (`lora_path`)."""

    def __init__(self, base_url: str, config: ClientConfig, adapter: str) -> None:
        super().__init__(base_url, config)
        self.adapter = adapter

    async def generate(self, request: GenerateInput) -> GenerateOutput:
        if isinstance(request, dict):
            request = {**request, "lora_path": self.adapter}
        else:
            request = msgspec.structs.replace(request, lora_path=self.adapter)
        return await super().generate(request)


@contextmanager
def lora_proxy(db_url: str, model_dir: Path, worker_url: str, adapter: str) -> Iterator[Proxy]:
    """A proxy on a migrated database in front of `worker_url`, serving the policy as `adapter`."""
    hasher = key_hasher(db_url)
    admin_key = run_db(db_url, lambda factory: create_admin_key(factory, hasher))
    session_id, session_key = run_db(db_url, lambda factory: new_session_key(factory, hasher))
    serving = ServingConfig(
        model=str(model_dir), worker_urls=[worker_url], lora_adapter=adapter,
        client=ClientConfig(connect_timeout_s=2.0, request_timeout_s=60.0),
    )
    with serve_proxy_in_thread(ProxyConfig(port=0), storage_config(db_url), serving) as base_url:
        yield Proxy(base_url, db_url, admin_key, session_id, session_key)
