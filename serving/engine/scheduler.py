"""The continuous-batching decode loop: one thread owns the model and every running sequence.

Between two decode steps the thread runs queued commands (new sequences, aborts, pause, continue,
weight swaps), prefills newly admitted sequences and merges them into the running batch, and drops
finished ones. The event loop talks to it only through a thread-safe inbox; results go back in one
`call_soon_threadsafe` per step. torch releases the GIL inside the forward, so serving stays responsive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from serving.engine.adapters import LoraAdapter, LoraLayers
from serving.engine.batch import HEADROOM, PaddedBatch, PaddedKVCache, merge, prefill_inputs, prefilled_batch
from serving.engine.grammar import token_bitmasks
from serving.engine.metrics import EngineMetrics
from serving.engine.sampling import RowSampling, choose_tokens
from serving.engine.sequence import Sequence, SequenceUpdate

logger = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
Sink = asyncio.Queue[tuple[int, SequenceUpdate]]
"""Where one request's sequences send their (index, update) pairs, on the event loop."""
PREFILL_TOKEN_BUDGET = 8192
"""Most padded prompt tokens prefilled in one forward; longer groups wait for the next round."""


@dataclass(frozen=True, slots=True)
class SwapResult:
    success: bool
    message: str
    num_paused_requests: int = 0


@dataclass(slots=True)
class _PendingSwap:
    load: Callable[[torch.nn.Module], None]
    """Copies the new weights into the live model (run by the decode thread, between steps)."""
    version: str | None
    future: concurrent.futures.Future[SwapResult]


class Engine:
    """Owns the model, the decode thread and every sequence in flight."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_batch_size: int,
                 metrics: EngineMetrics, weight_version: str = "default") -> None:
        self.tokenizer = tokenizer
        """The decode thread's own tokenizer (stop strings); the event loop uses another copy."""
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self.weight_version = weight_version
        """Read by the event loop; written by the decode thread on a swap."""
        self.paused = False
        self.last_progress = time.monotonic()
        """When the decode thread last produced tokens (for /health_generate)."""
        self._model = model
        self._dtype = next(model.parameters()).dtype
        self._lora = LoraLayers(model)
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waiting: deque[Sequence] = deque()
        self._retracted: list[Sequence] = []
        self._rows: list[Sequence] = []
        self._batch: PaddedBatch | None = None
        self._pending_swap: _PendingSwap | None = None
        self._outbox: list[tuple[Sink, tuple[int, SequenceUpdate]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def running(self) -> bool:
        """Whether the decode thread is up and taking work."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ---- event-loop side -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="flywheel-decode", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._inbox.put(self._shutdown)
        if self._thread is not None:
            self._thread.join(timeout)

    def deliverer(self, sink: Sink, index: int) -> Callable[[SequenceUpdate], None]:
        """A sequence's `deliver`: its updates reach `sink` on the event loop as (index, update)."""
        def deliver(update: SequenceUpdate) -> None:
            self._outbox.append((sink, (index, update)))
        return deliver

    def submit(self, sequences: list[Sequence]) -> None:
        self._inbox.put(lambda: self._add(sequences))

    def abort(self, *, rid: str = "", abort_all: bool = False, sequence: Sequence | None = None) -> None:
        """SGLang's /abort_request: by rid prefix, everything, or one sequence object."""
        self._inbox.put(lambda: self._abort_matching(rid, abort_all, sequence))

    async def pause(self, mode: PauseMode) -> None:
        await self._call(lambda: self._pause(mode))

    async def resume(self) -> None:
        await self._call(self._resume)

    async def set_weight_version(self, version: str, abort_all: bool) -> None:
        await self._call(lambda: self._set_version(version, abort_all))

    async def install_adapter(self, adapter: LoraAdapter) -> None:
        """Hook the layers `adapter` targets, on the decode thread (between two steps)."""
        await self._call(lambda: self._lora.install(adapter))

    async def swap_weights(self, load: Callable[[torch.nn.Module], None], version: str | None,
                           abort_all: bool) -> SwapResult:
        """Run `load(model)` between steps: now if paused or idle, else once running requests end
        (SGLang's writer lock: no new sequence is admitted meanwhile)."""
        future: concurrent.futures.Future[SwapResult] = concurrent.futures.Future()

        def queue_swap() -> None:
            if abort_all:
                self._abort_matching("", True, None)
            if self._pending_swap is not None:  # callers serialise updates; never leave one hanging
                self._pending_swap.future.set_result(SwapResult(False, "Superseded by a later update."))
            self._pending_swap = _PendingSwap(load, version, future)
        self._inbox.put(queue_swap)
        return await asyncio.wrap_future(future)

    async def _call(self, command: Callable[[], Any]) -> Any:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            future.set_result(command())
        self._inbox.put(run)
        return await asyncio.wrap_future(future)

    # ---- decode thread ---------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # thread-local: the decode thread never builds a graph
        while not self._stopping:
            self._drain_inbox(block=not self._has_work())
            if self._stopping:
                break
            self._apply_swap_if_ready()
            if not self.paused and self._pending_swap is None and self._waiting:
                self._guarded(self._admit)
            if not self.paused and self._batch is not None:
                self._guarded(self._step)
            self._ship()
        self._ship()

    def _has_work(self) -> bool:
        return not self.paused and (self._batch is not None or bool(self._waiting)
                                    or self._pending_swap is not None)

    def _drain_inbox(self, block: bool) -> None:
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            self._ship()
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _guarded(self, work: Callable[[], None]) -> None:
        """Run a prefill or step; if it raises, fail its sequences instead of killing the thread."""
        try:
            work()
        except Exception as exc:  # the decode loop must outlive any one bad batch
            logger.exception("decode step failed; aborting %d sequences", len(self._rows))
            for seq in self._rows:
                if not seq.finished:
                    seq.abort(f"Internal error in the CPU engine: {exc}")
                    seq.flush(self.weight_version)
            self._rows, self._batch = [], None
            self._observe_queues()

    def _add(self, sequences: list[Sequence]) -> None:
        for seq in sequences:
            if seq.max_new_tokens == 0:  # nothing to generate: answer at once, as SGLang does
                seq.finish_reason = {"type": "length", "length": 0}
                seq.flush(self.weight_version)
            else:
                self._waiting.append(seq)
        self._observe_queues()

    def _admit(self) -> None:
        room = self.max_batch_size - len(self._rows)
        group: list[Sequence] = []
        width = 0
        while self._waiting and len(group) < room:
            seq = self._waiting[0]
            longest = max(width, len(seq.prompt_ids) + len(seq.output_ids))
            if group and longest * (len(group) + 1) > PREFILL_TOKEN_BUDGET:
                break
            group.append(self._waiting.popleft())
            width = longest
        if group:
            self._prefill(group)
        self._observe_queues()

    def _prefill(self, group: list[Sequence]) -> None:
        """Prefill prompts (plus tokens already made, for retracted sequences); sample their next token."""
        prompts = [seq.prompt_ids + seq.output_ids for seq in group]
        input_ids, positions, mask, row_mask = prefill_inputs(prompts, self._dtype)
        cache = PaddedKVCache(len(group), input_ids.shape[1] + HEADROOM)
        self._rows.extend(group)  # so a failure below aborts them too
        logits = self._forward(input_ids, positions, mask, cache, group)
        cache.length = input_ids.shape[1]
        tokens = self._sample(logits, group)
        self.metrics.observe_prefill(len(group))
        self._batch = merge(self._batch, prefilled_batch(cache, row_mask, prompts, tokens))
        self._retire()

    def _step(self) -> None:
        assert self._batch is not None
        input_ids, positions, mask = self._batch.decode_inputs()
        logits = self._forward(input_ids, positions, mask, self._batch.cache, self._rows)
        tokens = self._sample(logits, self._rows)
        self._batch.advance(tokens)
        self.metrics.observe_step(len(tokens), len(tokens))
        self._retire()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 cache: PaddedKVCache, rows: list[Sequence]) -> torch.Tensor:
        with self._lora.rows([seq.lora for seq in rows]):  # each row with its own adapter, if any
            out = self._model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                              past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]  # (B, V)

    def _sample(self, logits: torch.Tensor, rows: list[Sequence]) -> list[int]:
        masks = token_bitmasks([seq.grammar for seq in rows], logits.shape[-1])
        specs = [RowSampling(seq.options, seq.output_ids, seq.generator, seq.blocked_ids,
                             seq.top_logprobs_num, mask) for seq, mask in zip(rows, masks, strict=True)]
        choice = choose_tokens(logits, specs)
        for seq, token, logprob, top in zip(rows, choice.token_ids, choice.logprobs, choice.top_logprobs,
                                            strict=True):
            seq.append(token, logprob, top, self.tokenizer)
        self.last_progress = time.monotonic()
        return choice.token_ids

    def _retire(self) -> None:
        """Send every row's news; drop finished rows from the batch."""
        for seq in self._rows:
            seq.flush(self.weight_version)
            if seq.finished:
                self.metrics.finished.labels(seq.finish_reason["type"]).inc()  # type: ignore[index]
        keep = [i for i, seq in enumerate(self._rows) if not seq.finished]
        if len(keep) < len(self._rows):
            self._batch = self._batch.keep(keep) if self._batch is not None else None
            self._rows = [self._rows[i] for i in keep]
        self._observe_queues()

    def _abort_matching(self, rid: str, abort_all: bool, sequence: Sequence | None) -> None:
        if not abort_all and not rid and sequence is None:
            return  # SGLang ignores an empty rid without abort_all

        def hit(seq: Sequence) -> bool:
            return abort_all or seq is sequence or (bool(rid) and seq.rid.startswith(rid))
        for seq in [*self._waiting, *self._retracted]:
            if hit(seq):
                seq.abort("Abort in waiting queue" if not seq.output_ids else "Aborted")
                seq.flush(self.weight_version)
        self._waiting = deque(seq for seq in self._waiting if not seq.finished)
        self._retracted = [seq for seq in self._retracted if not seq.finished]
        for seq in self._rows:
            if hit(seq):
                seq.abort("Aborted")
        self._retire()

    def _pause(self, mode: PauseMode) -> None:
        if mode == "abort":
            self._abort_matching("", True, None)
        elif mode == "retract" and self._rows:
            # Drop their KV; on continue they are prefilled again from prompt + tokens so far.
            for seq in self._rows:
                seq.num_retractions += 1
            self._retracted = self._rows + self._retracted
            self._rows, self._batch = [], None
        self.paused = True
        logger.info("generation paused (mode=%s)", mode)

    def _resume(self) -> None:
        self._waiting.extendleft(reversed(self._retracted))
        self._retracted = []
        self.paused = False
        self._observe_queues()
        logger.info("generation continued")

    def _apply_swap_if_ready(self) -> None:
        swap = self._pending_swap
        if swap is None or not (self.paused or self._batch is None):
            return
        self._pending_swap = None
        try:
            swap.load(self._model)
        except Exception as exc:  # checked before queueing; anything left is reported, not raised here
            logger.exception("weight update failed")
            self.metrics.weight_updates.labels("failure").inc()
            swap.future.set_result(SwapResult(False, f"Failed to update weights: {exc}."))
            return
        message = "Succeeded to update model weights."
        if swap.version is not None:
            self._change_version(swap.version)
            message += f" Weight version updated to {swap.version}."
        self.metrics.weight_updates.labels("success").inc()
        swap.future.set_result(SwapResult(True, message))

    def _set_version(self, version: str, abort_all: bool) -> None:
        if abort_all:
            self._abort_matching("", True, None)
        self._change_version(version)

    def _change_version(self, version: str) -> None:
        if version == self.weight_version:
            return
        for seq in [*self._rows, *self._retracted, *self._waiting]:
            seq.record_weight_change(self.weight_version)
        logger.info("weight version %s -> %s", self.weight_version, version)
        self.weight_version = version

    def _shutdown(self) -> None:
        self._abort_matching("", True, None)
        if self._pending_swap is not None:
            self._pending_swap.future.set_result(SwapResult(False, "The engine is shutting down."))
            self._pending_swap = None
        self._stopping = True

    def _observe_queues(self) -> None:
        self.metrics.observe_queues(len(self._rows), len(self._waiting) + len(self._retracted))

    def _ship(self) -> None:
        if not self._outbox or self._loop is None:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._loop.call_soon_threadsafe(_deliver_all, batch)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            logger.debug("event loop closed; dropped %d updates", len(batch))


def _deliver_all(batch: list[tuple[Sink, tuple[int, SequenceUpdate]]]) -> None:
    for sink, item in batch:
        sink.put_nowait(item)
