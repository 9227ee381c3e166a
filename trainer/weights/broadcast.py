"""The trainer's end of a distributed weight push (`trainer/weights/distributed.py`), run in the policy
actor's process, rank 0 of the weight-update group: where the group meets, a checkpoint's tensors planned
into buckets, and each bucket read from the checkpoint for the broadcast (`Policy.init_weight_group`,
`weight_buckets`, `broadcast_weights`).

The tensors broadcast are the checkpoint's: the very bytes `/update_weights_from_disk` would have the
workers read, tied tensors once as the checkpoint holds them, read one bucket at a time. So a push gives
the workers what a disk push would, whatever weights the actor holds when it comes (a rollback, a resumed
run), and holds at most one bucket in memory beside the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from serving.models.loading import checkpoint_files
from serving.threaded_server import free_port
from serving.weight_group import TensorMeta, address_toward

# safetensors' dtype codes, as torch names them.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool",
}


@dataclass(frozen=True)
class GroupEndpoint:
    """Where the weight-update group meets and over what: rank 0's store address and port, the backend."""

    address: str
    port: int
    backend: str


def group_endpoint(toward_host: str, address: str | None, port: int | None, backend: str) -> GroupEndpoint:
    """The configured endpoint with its `auto`s resolved in the process that will host the store: no
    `address` is this machine's address on the route to `toward_host` (a worker), no `port` a port free
    here now, backend `auto` NCCL when this process sees a GPU, else gloo."""
    host = address or address_toward(toward_host)
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return GroupEndpoint(host, port or free_port(host), backend)


def checkpoint_metas(checkpoint: Path) -> list[TensorMeta]:
    """Every tensor of the safetensors checkpoint at `checkpoint` (a model directory), in file order, from
    the files' headers alone."""
    metas: list[TensorMeta] = []
    for file in checkpoint_files(checkpoint):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                code = piece.get_dtype()
                dtype = _SAFETENSORS_DTYPES.get(code)
                if dtype is None:
                    raise ValueError(f"{file}: tensor {name} has dtype {code}, which torch lacks")
                metas.append(TensorMeta(name, dtype, tuple(piece.get_shape())))
    return metas


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """`metas` in order, cut into buckets of at most `bucket_bytes` each (a larger tensor goes alone)."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for meta in metas:
        if not buckets or (buckets[-1] and size + meta.nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(meta)
        size += meta.nbytes
    return buckets


def read_tensors(checkpoint: Path, names: Sequence[str], device: torch.device) -> list[torch.Tensor]:
    """The tensors `names` of the checkpoint at `checkpoint`, in that order, on `device`."""
    wanted = set(names)
    found: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(checkpoint):
        with safe_open(file, framework="pt", device=str(device)) as handle:
            for name in wanted.intersection(handle.keys()):
                found[name] = handle.get_tensor(name)
    missing = [name for name in names if name not in found]
    if missing:
        raise KeyError(f"{checkpoint} has no tensor {', '.join(missing[:8])}")
    return [found[name] for name in names]
