"""CPU engine throughput: output tokens/s at 1, 8 and 16 concurrent /generate requests, beside a
sequential loop of plain `model.generate` on the same model in the same process.

    .venv/bin/python benchmarks/engine_throughput.py [--model demo] [--new-tokens 64] [--threads N]

Every request makes exactly `--new-tokens` tokens (greedy with `ignore_eos`; the baseline uses
`min_new_tokens`), so the rows compare like with like. Both sides are warmed up before timing, and
each row is the best of `--repeats` runs: on a shared machine other processes only ever slow a run
down, so the best run is the closest to what the code itself can do.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import torch

from serving.config import CpuEngineConfig, ServingConfig
from serving.engine.server import create_engine_app, serve_in_thread
from serving.models.loading import LoadedModel, load_model

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "How do airplanes fly?",
    "Give me three tips for learning Python.", "Why is the sky blue?", "Explain photosynthesis briefly.",
    "What is 17 times 23?", "Name a famous painting and its painter.", "How does a refrigerator work?",
    "Suggest a name for a pet turtle.", "What causes the seasons on Earth?", "Describe a cat briefly.",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.", "What is a prime number?",
    "How many legs does a spider have?",
]


def prompts(loaded: LoadedModel, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def baseline_tokens_per_s(loaded: LoadedModel, prompt_ids: list[list[int]], new_tokens: int
                          ) -> tuple[float, int]:
    """A sequential loop of `model.generate`, one prompt at a time (greedy, exactly new_tokens each)."""
    model = loaded.model
    pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id

    def one(ids: list[int]) -> int:
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return out.shape[1] - len(ids)

    one(prompt_ids[0])  # warm-up
    started = time.perf_counter()
    made = sum(one(ids) for ids in prompt_ids)
    return made / (time.perf_counter() - started), 1


def padded_batch_tokens_per_s(loaded: LoadedModel, prompt_ids: list[list[int]], new_tokens: int
                              ) -> tuple[float, int]:
    """One left-padded `model.generate` over all prompts: the static-batch ceiling the engine chases."""
    pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    started = time.perf_counter()
    with torch.no_grad():
        out = loaded.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    made = (out.shape[1] - width) * len(prompt_ids)
    return made / (time.perf_counter() - started), len(prompt_ids)


def best_of(repeats: int, run: Callable[[], tuple[float, int]]) -> tuple[float, int]:
    """The run with the most tokens/s (and its batch size)."""
    return max((run() for _ in range(repeats)), key=lambda result: result[0])


async def engine_tokens_per_s(url: str, prompt_ids: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """All prompts at once against the engine; aggregate output tokens per second."""
    body: dict[str, Any] = {"sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                                "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/generate", json={**body, "input_ids": ids})
                                         for ids in prompt_ids))
        elapsed = time.perf_counter() - started
        made = 0
        for answer in answers:
            answer.raise_for_status()
            made += answer.json()["meta_info"]["completion_tokens"]
        info = (await client.get("/server_info")).json()
    return made / elapsed, info["internal_states"][0]["max_batch_size_observed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--baseline-requests", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the best is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    print(f"model {args.model}: {sum(p.numel() for p in loaded.model.parameters()) / 1e6:.0f}M params, "
          f"torch threads {torch.get_num_threads()}, {args.new_tokens} new tokens per request")
    rows: list[tuple[str, int, float, str]] = []
    baseline_prompts = prompts(loaded, args.baseline_requests)
    run_baseline = partial(baseline_tokens_per_s, loaded, baseline_prompts, args.new_tokens)
    baseline, _ = best_of(args.repeats, run_baseline)
    rows.append(("model.generate, sequential", 1, baseline, "-"))
    padded, _ = best_of(args.repeats, partial(padded_batch_tokens_per_s, loaded, prompts(loaded, 8),
                                              args.new_tokens))
    rows.append(("model.generate, padded batch", 8, padded, "8"))
    config = ServingConfig(model=args.model, cpu=CpuEngineConfig(max_batch_size=16, num_threads=args.threads))
    with serve_in_thread(create_engine_app(config, loaded)) as url:
        asyncio.run(engine_tokens_per_s(url, prompts(loaded, 1), 8))  # warm-up
        for concurrency in (1, 8, 16):
            batch_prompts = prompts(loaded, concurrency)
            rate, batch = best_of(args.repeats, lambda p=batch_prompts: asyncio.run(  # type: ignore[misc]
                engine_tokens_per_s(url, p, args.new_tokens)))
            rows.append(("CPU engine, concurrent", concurrency, rate, str(batch)))
    print(f"\n| {'backend':<28} | {'requests':>8} | {'output tok/s':>12} | {'vs baseline':>11} | "
          f"{'max batch':>9} |")
    print(f"| {'-' * 28} | {'-' * 8}: | {'-' * 12}: | {'-' * 11}: | {'-' * 9}: |")
    for name, concurrency, rate, batch in rows:
        print(f"| {name:<28} | {concurrency:>8} | {rate:>12.1f} | {rate / baseline:>10.2f}x | {batch:>9} |")


if __name__ == "__main__":
    main()
