"""Trainer costs on CPU: one GRPO step (B sequences × T tokens) and one weight push (safetensors save +
`/update_weights_from_disk` into a CPU engine on a loopback port), printed as a table.

    .venv/bin/python benchmarks/trainer_step.py [--model demo] [--batch 16] [--tokens 64] [--threads N]

The policy runs in this process (no Ray) so the numbers are the model's own; the driver adds a claim
and a record (milliseconds). Sequences are random token ids with their true logprobs under the
model (so the batch is on-policy), 4 per group, random rewards. Each row is the best of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from serving.client import SGLangClient
from serving.config import ClientConfig, CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import load_model
from storage.records import TrainingSample
from trainer.batching import collate
from trainer.config import TrainerConfig
from trainer.policy import Policy


def on_policy_samples(
    policy: Policy, batch: int, tokens: int, prompt: int, seed: int
) -> list[TrainingSample]:
    vocab = policy._model.get_input_embeddings().weight.shape[0]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, tokens), dtype=np.int32)
    mask = np.arange(tokens) >= prompt
    samples = [
        TrainingSample(
            trajectory_id=i,
            token_ids=ids[i],
            loss_mask=mask,
            logprobs=np.zeros(tokens, np.float32),
            versions=np.where(mask, 0, -1).astype(np.int32),
            reward=float(rng.random()),
            group_id=f"g{i // 4}",
        )
        for i in range(batch)
    ]
    logprobs, _ = policy._no_grad_logprobs(collate(samples), with_entropy=False)  # (B, T-1)
    for sample, row in zip(samples, logprobs, strict=True):
        sample.logprobs[1:] = row.numpy()
    return samples


def best(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return min(times), result


async def push(url: str, path: str, version: int) -> float:
    async with SGLangClient(url, ClientConfig()) as client:
        started = time.perf_counter()
        answer = await client.update_weights_from_disk(path, str(version))
        elapsed = time.perf_counter() - started
        assert answer["success"], answer
        assert (await client.model_info())["weight_version"] == str(version)
    return elapsed


def time_split_step(args: argparse.Namespace, samples: list[TrainingSample]) -> float:
    policy = Policy(args.model, TrainerConfig(lr=1e-6, num_threads=args.threads, minibatches=2))
    seconds, _ = best(lambda: policy.train_step(samples, 0), args.repeats)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="demo")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens per sequence (not trained)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    policy = Policy(args.model, TrainerConfig(lr=1e-6, num_threads=args.threads))
    load_s = time.perf_counter() - started
    samples = on_policy_samples(policy, args.batch, args.tokens, args.prompt, seed=0)
    rows = [("policy load (fp32 + AdamW)", load_s, "")]
    step_s, stats = best(lambda: policy.train_step(samples, 0), args.repeats)
    gap = stats["prox_behave/max_abs_diff"]  # of the last repeat: earlier repeats moved the weights
    note = f"{stats['perf/tokens_per_s']:.0f} tok/s; π_prox in the training forward (last |Δ| {gap:.1e})"
    rows.append((f"GRPO step, {args.batch}×{args.tokens}, 1 update", step_s, note))
    split_s = time_split_step(args, samples)
    rows.append(
        (f"GRPO step, {args.batch}×{args.tokens}, 2 minibatches", split_s, "π_prox in its own no-grad pass")
    )

    serving = ServingConfig(model=args.model, cpu=CpuEngineConfig(num_threads=args.threads))
    engine_model = load_model(args.model)
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve_in_thread(create_engine_app(serving, engine_model)) as url,
    ):
        for version in range(1, args.repeats + 2):
            save_started = time.perf_counter()
            path = policy.save(tmp, version)
            save_s = time.perf_counter() - save_started
            reload_s = asyncio.run(push(url, path, version))
            size_mb = sum(f.stat().st_size for f in Path(path).iterdir()) / 2**20
            if version == 1:
                continue  # warm-up: first write and first read of the page cache
            rows.append((f"push v{version}: save", save_s, f"{size_mb:.0f} MB checkpoint dir"))
            rows.append((f"push v{version}: engine reload", reload_s, "/update_weights_from_disk"))
            rows.append((f"push v{version}: save + reload", save_s + reload_s, ""))

    print(f"\nmodel {args.model}, torch threads {torch.get_num_threads()}\n")
    print(f"{'what':<40} {'seconds':>8}  notes")
    for what, seconds, note in rows:
        print(f"{what:<40} {seconds:>8.2f}  {note}")


if __name__ == "__main__":
    main()
