"""The recorder the proxy runs: group commit (proxy/recording/recorder.py); then the conversation index
learns every completion written, so the session's next call can chain onto it, and the completion and
token metrics count it (the one place that counts what was served)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.conversations.index import ConversationIndex
from proxy.conversations.text import ConversationKeys
from proxy.metrics import ProxyMetrics
from proxy.recording.recorder import Recorder
from storage.engine import SessionFactory
from storage.records import CompletionRecord


class IndexingRecorder(Recorder):
    """The completion recorder that tells the conversation index about every completion it wrote."""

    def __init__(
        self, session_factory: SessionFactory, batch_max: int, metrics: ProxyMetrics,
        index: ConversationIndex, retry_s: float = 0.0,
        on_unavailable: Callable[[BaseException], object] | None = None,
    ) -> None:
        super().__init__(session_factory, batch_max, metrics, retry_s, on_unavailable)
        self.index = index

    async def record(
        self, records: Sequence[CompletionRecord], keys: ConversationKeys | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        """Record, then index and count; `keys` (the call's conversation keys) spare parsing the request
        again; `prompt_tokens` is the length of the whole prompt(s) the records answered."""
        await super().record(records)
        self.index.learn(records, keys)
        metrics = self._metrics
        for record in records:
            metrics.completions.labels(record.finish_reason).inc()
        metrics.tokens.labels("prompt").inc(prompt_tokens)
        metrics.tokens.labels("completion").inc(sum(len(record.output_ids) for record in records))
