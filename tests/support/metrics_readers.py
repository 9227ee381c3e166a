"""Readers of what the metrics endpoints and sinks wrote, as their users' tools see it: Prometheus text
(`prometheus_client`'s parser), TensorBoard event files (TensorBoard's own EventAccumulator), and a W&B
offline run file (its records, decoded with wandb's own protobuf messages)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
"""(sample name, its labels) → value."""


def scrape(url: str) -> Samples:
    """Every sample of a /metrics page."""
    answer = httpx.get(url, timeout=30)
    assert answer.status_code == 200, answer.text
    return {
        (sample.name, frozenset(sample.labels.items())): float(sample.value)
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def value(samples: Samples, series: str, /, **labels: str) -> float | None:
    """The sample `series` with exactly these labels, or None when the page has none."""
    return samples.get((series, frozenset(labels.items())))


def total(samples: Samples, series: str, /, **labels: str) -> float:
    """The sum of the samples `series` whose labels include these (0 when none)."""
    wanted = set(labels.items())
    return sum(v for (sample, got), v in samples.items() if sample == series and wanted <= got)


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag → [(step, value)] of the event files in `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def tensorboard_texts(log_dir: Path) -> dict[str, str]:
    """tag → the text logged under it, as the TensorBoard text plugin reads it back."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    texts = {}
    for tag in events.Tags()["tensors"]:
        tensor = events.Tensors(tag)[0].tensor_proto
        texts[tag.removesuffix("/text_summary")] = tensor.string_val[0].decode()
    return texts


_WANDB_HEADER = 7  # ":W&B", a 2-byte magic, a version byte
_BLOCK = 32 * 1024  # the LevelDB log layout the run file uses: records never straddle a block's header
_RECORD_HEADER = 7  # crc32 (4), length (2, little-endian), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(run_file: Path) -> list[Any]:
    """The protobuf Records of a W&B offline run file (`run-<id>.wandb`), in order."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    records, pending, offset = [], b"", _WANDB_HEADER
    while offset + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _RECORD_HEADER:  # a block's tail too small for a header is padding
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, offset)
        start = offset + _RECORD_HEADER
        chunk, offset = data[start:start + length], start + length
        if kind == 0 and length == 0:
            break  # zero padding at the end of the file
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_file: Path) -> list[tuple[int, dict[str, Any]]]:
    """The (step, {key: value}) of every history row logged in a W&B offline run file."""
    rows = []
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            rows.append((record.history.step.num, items))
    return rows


def wandb_config(run_file: Path) -> dict[str, Any]:
    """The run config a W&B offline run file holds (from its run record and config updates)."""
    config: dict[str, Any] = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind not in ("run", "config"):
            continue
        for update in (record.run.config if kind == "run" else record.config).update:
            config[update.key or "/".join(update.nested_key)] = json.loads(update.value_json)
    return config


def try_scrape(url: str) -> Samples | None:
    """`scrape(url)`, or None while nothing answers there (a process still starting, or gone)."""
    try:
        return scrape(url)
    except httpx.TransportError:
        return None
