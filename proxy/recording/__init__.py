"""Recording completions: group commit of concurrent writes (`recorder.py`), the recorder that also
teaches the conversation index and counts what was served (`indexing.py`), and the records of one call
(`records.py`).

May import `proxy.conversations`, `proxy.workers`, the kernel and storage."""
