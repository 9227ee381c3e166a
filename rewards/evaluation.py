"""Evaluating a candidate policy version on a held-out eval set, for eval-gated promotion.

`Evaluator.evaluate(checkpoint, version)` loads the checkpoint on the eval worker (a worker no client is
served by, so an evaluation never stalls serving), renders each item's messages with the model's chat
template exactly as the proxy does (no special tokens added; the template writes them), generates on
the worker through SGLang's `/generate`, and scores each answer with the configured reward hook. Nothing
is recorded as training data: the eval worker's generations never reach the proxy or the database.
An item's score is the hook's session reward, else the mean of its completion rewards, else 0 (no
opinion); the version's score is the mean over items.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rewards.config import EvalConfig
from rewards.hooks.contract import CompletionView, HookContext, HookPool, HookResult, SessionInput
from rewards.hooks.pool import ProcessHookPool
from rewards.hooks.registry import HookRegistry
from serving.client import SGLangClient
from serving.config import ClientConfig
from serving.models.loading import load_tokenizer
from storage.records import EvalResult


class EvalSetError(ValueError):
    """The eval set file is missing or malformed (the message names the line)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalItem:
    id: str
    messages: tuple[dict[str, Any], ...]
    task: Any = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


def parse_item(line: str, number: int) -> EvalItem:
    """One JSONL line as an item: `messages` (or `prompt`, one user message), an optional `id` (the line
    number otherwise), `task`, `metadata`, and `answer` (kept in the metadata, where hooks look)."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EvalSetError(f"line {number}: not JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise EvalSetError(f"line {number}: an item is a JSON object")
    if "messages" in raw:
        messages = raw["messages"]
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise EvalSetError(f"line {number}: `messages` must be a non-empty list of message objects")
    elif isinstance(raw.get("prompt"), str):
        messages = [{"role": "user", "content": raw["prompt"]}]
    else:
        raise EvalSetError(f"line {number}: an item needs `messages` or a `prompt` string")
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise EvalSetError(f"line {number}: `metadata` must be an object")
    if "answer" in raw:
        metadata = {**metadata, "answer": raw["answer"]}
    return EvalItem(
        id=str(raw.get("id", number)), messages=tuple(messages), task=raw.get("task"), metadata=metadata
    )


def load_eval_set(path: str | Path, limit: int | None = None) -> list[EvalItem]:
    """The items of a JSONL eval set (blank lines skipped); EvalSetError when it is empty, malformed, or
    repeats an id."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EvalSetError(f"cannot read the eval set {path}: {exc}") from exc
    items = [parse_item(line, number) for number, line in enumerate(lines, 1) if line.strip()]
    if limit is not None:
        items = items[:limit]
    if not items:
        raise EvalSetError(f"the eval set {path} has no items")
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        raise EvalSetError(f"the eval set {path} repeats item ids")
    return items


def item_score(result: HookResult | None) -> float:
    """An item's score from its hook's answer: the session reward, else the mean completion reward, else 0."""
    if result is None or result.empty:
        return 0.0
    if result.session is not None:
        return float(result.session)
    return sum(result.completions.values()) / len(result.completions)


def mean_score(scores: Sequence[float]) -> float:
    return sum(scores) / len(scores) if scores else 0.0


class Evaluator:
    """Scores checkpoints on the eval set (see the module docstring); a `CandidateGate` for the trainer."""

    def __init__(
        self,
        config: EvalConfig,
        items: Sequence[EvalItem],
        client: SGLangClient,
        tokenizer: Any,
        registry: HookRegistry,
        pool: HookPool,
        http: httpx.AsyncClient,
    ) -> None:
        if config.hook is None:
            raise ValueError("online.eval.hook names no reward hook to score the eval set with")
        self._config = config
        self._items = list(items)
        self._client = client
        self._tokenizer = tokenizer
        self._hook = registry.resolve(config.hook, "session")
        self._pool = pool
        self._http = http
        self._prompts = [self._render(item) for item in self._items]

    def _render(self, item: EvalItem) -> list[int]:
        text = self._tokenizer.apply_chat_template(
            list(item.messages), tokenize=False, add_generation_prompt=True
        )
        return list(self._tokenizer.encode(str(text), add_special_tokens=False))

    async def evaluate(self, checkpoint_path: str, version: int) -> EvalResult:
        """Load `checkpoint_path` on the eval worker as `version`, answer and score every item."""
        started = time.perf_counter()
        loaded = await self._client.update_weights_from_disk(checkpoint_path, str(version), flush_cache=True)
        if loaded.get("success") is False:
            raise RuntimeError(
                f"the eval worker did not load {checkpoint_path}: {loaded.get('message', loaded)}"
            )
        load_s = time.perf_counter() - started
        gate = asyncio.Semaphore(self._config.concurrency)
        scored = await asyncio.wait_for(
            asyncio.gather(
                *(
                    self._item(item, prompt, gate)
                    for item, prompt in zip(self._items, self._prompts, strict=True)
                )
            ),
            self._config.timeout_s,
        )
        scores = {item.id: score for item, (score, _text) in zip(self._items, scored, strict=True)}
        return EvalResult(
            score=mean_score(list(scores.values())),
            item_scores=scores,
            details={
                "worker": self._client.base_url,
                "version": version,
                "items_count": len(scores),
                "load_s": load_s,
                "samples": [
                    {"id": item.id, "answer": text[:200]}
                    for item, (_s, text) in zip(self._items[:3], scored, strict=False)
                ],
            },
        )

    async def _item(self, item: EvalItem, prompt: list[int], gate: asyncio.Semaphore) -> tuple[float, str]:
        async with gate:
            output = await self._client.generate(
                {
                    "input_ids": prompt,
                    "sampling_params": {
                        "max_new_tokens": self._config.max_new_tokens,
                        "temperature": self._config.temperature,
                    },
                    "rid": f"eval-{item.id}-{time.monotonic_ns()}",
                }
            )
        if not isinstance(output, dict):
            raise RuntimeError("the eval worker answered a list for one prompt")
        output_ids = tuple(int(t) for t in output.get("output_ids") or ())
        text = self._tokenizer.decode(list(output_ids), skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        completion = CompletionView(
            id=f"eval-{item.id}",
            parent_id=None,
            messages=item.messages,
            message=message,
            text=text,
            prompt_ids=tuple(prompt),
            output_ids=output_ids,
            finish_reason=str((output.get("meta_info") or {}).get("finish_reason", {}).get("type", "stop")),
            trainable=True,
        )
        session = SessionInput(
            session_id=f"eval-{item.id}",
            group_id=None,
            task=item.task,
            metadata=item.metadata,
            completions=(completion,),
        )
        context = HookContext(
            job_id=f"eval/{item.id}",
            attempt=1,
            timeout_s=self._config.timeout_s,
            pool=self._pool,
            http=self._http,
        )
        result = await self._hook(session, context)
        if result is not None and not isinstance(result, HookResult):
            raise RuntimeError("a session hook answered a group result")
        score = item_score(result)
        if not math.isfinite(score):
            raise RuntimeError(f"the eval hook scored item {item.id} {score!r}")
        return score, text


@contextlib.asynccontextmanager
async def open_evaluator(
    config: EvalConfig, model_dir: str | Path, client_config: ClientConfig | None = None
) -> AsyncIterator[Evaluator]:
    """An evaluator on `config.worker_url`, with the hook's worker processes and HTTP client, for a run."""
    if config.dataset is None or config.hook is None or config.worker_url is None:
        raise ValueError(
            "eval-gated promotion needs online.eval.dataset, online.eval.hook and online.eval.worker_url"
        )
    items = load_eval_set(config.dataset, config.limit)
    registry = HookRegistry.built_in()
    tokenizer = await asyncio.to_thread(load_tokenizer, Path(model_dir))
    async with (
        SGLangClient(config.worker_url, client_config or ClientConfig()) as client,
        ProcessHookPool(1) as pool,
        httpx.AsyncClient(follow_redirects=False) as http,
    ):
        yield Evaluator(config, items, client, tokenizer, registry, pool, http)
