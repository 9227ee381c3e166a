"""The recorder the proxy runs: redaction of the stored JSON (proxy/recording/redaction.py), group commit
(proxy/recording/recorder.py); then the conversation index learns every completion written, as it was
served (unredacted: the session's next call sends that text and chains onto it), and the completion and
token metrics count it (the one place that counts what was served)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.conversations.index import ConversationIndex
from proxy.conversations.text import ConversationKeys
from proxy.metrics import ProxyMetrics
from proxy.recording.recorder import Recorder
from proxy.recording.redaction import Redactor
from storage.engine import SessionFactory
from storage.records import CompletionRecord


class IndexingRecorder(Recorder):
    """The completion recorder that tells the conversation index about every completion it wrote;
    `redactor` redacts what is written (proxy.privacy), never what the index learns."""

    def __init__(
        self, session_factory: SessionFactory, batch_max: int, metrics: ProxyMetrics,
        index: ConversationIndex, retry_s: float = 0.0,
        on_unavailable: Callable[[BaseException], object] | None = None, redactor: Redactor | None = None,
    ) -> None:
        super().__init__(session_factory, batch_max, metrics, retry_s, on_unavailable)
        self.index = index
        self._redactor = redactor

    async def record(
        self, records: Sequence[CompletionRecord], keys: ConversationKeys | None = None,
        prompt_tokens: int = 0,
    ) -> None:
        """Redact, record, then index (the records as served) and count; `keys` (the call's conversation
        keys) spare parsing the request again; `prompt_tokens` is the length of the whole prompt(s) the
        records answered."""
        output_tokens = sum(len(record.output_ids) for record in records)
        redactor = self._redactor
        if redactor is not None and redactor.active:
            await super().record(await redactor.records_async(records, prompt_tokens + output_tokens))
        else:
            await super().record(records)
        self.index.learn(records, keys)
        metrics = self._metrics
        for record in records:
            metrics.completions.labels(record.finish_reason).inc()
        if records:
            metrics.saw_versions(records[-1].output_versions)
        metrics.tokens.labels("prompt").inc(prompt_tokens)
        metrics.tokens.labels("completion").inc(output_tokens)
