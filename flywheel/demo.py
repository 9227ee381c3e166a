"""The main job, for now: start a CPU engine with the demo model and ask it one chat question.

The next issue turns this into the whole training loop; the pieces used here (config layers, the
engine as a child process, the SGLang client, chat template → input_ids) are the ones it builds on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from flywheel.config import FlywheelConfig
from flywheel.processes import start_engine

DEMO_QUESTION = (
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell in total?"
)


async def run_demo(config: FlywheelConfig, config_path: str | None, overrides: Sequence[str]) -> str:
    """Return a short report: the question, the model's answer, and what the engine said about it."""
    from serving.client import SGLangClient
    from serving.models.loading import default_cache_dir, load_tokenizer, resolve_model_dir

    serving = config.serving
    started = time.perf_counter()
    # Convert the demo GGUF to its safetensors cache here, once, so the engine starts fast.
    model_dir = resolve_model_dir(serving.model, serving.cache_dir or default_cache_dir())
    tokenizer = load_tokenizer(model_dir)
    engine = start_engine(config_path, overrides, 0, config.run.dir / "logs")
    url = f"http://{serving.host}:{serving.port}"
    try:
        async with SGLangClient(url, serving.client) as client:
            await client.wait_until_healthy(timeout_s=300)
            ready = time.perf_counter()
            messages = [{"role": "user", "content": DEMO_QUESTION}]
            prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if not isinstance(prompt_ids, list):
                prompt_ids = prompt_ids["input_ids"]
            request = {
                "input_ids": list(prompt_ids),
                "sampling_params": {"max_new_tokens": 96, "temperature": 0.0},
                "return_logprob": True,
            }
            generated = time.perf_counter()
            response = await client.generate(request)
            elapsed = time.perf_counter() - generated
    except BaseException:
        tail = engine.tail()
        engine.stop()
        if tail:
            raise RuntimeError(f"the engine failed; its last log lines:\n{tail}") from None
        raise
    engine.stop()
    meta = response["meta_info"]
    tokens = meta["completion_tokens"]
    return (
        f"model:    {serving.model} ({model_dir})\n"
        f"question: {DEMO_QUESTION}\n"
        f"answer:   {response['text'].strip()}\n"
        f"({tokens} tokens in {elapsed:.1f} s, {tokens / elapsed:.1f} tok/s; finish {meta['finish_reason']}; "
        f"weight_version {meta['weight_version']}; engine ready after {ready - started:.1f} s)"
    )
