"""Recording completions: group commit of concurrent writes (`recorder.py`), the recorder that also
teaches the conversation index and counts what was served (`indexing.py`), the records of one call
(`records.py`), redaction of their stored JSON (`redaction.py`) and the purge of raw JSON past retention
(`retention.py`).

May import `proxy.conversations`, `proxy.workers`, the kernel and storage."""
