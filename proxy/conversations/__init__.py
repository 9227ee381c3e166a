"""Token-exact multi-turn conversations (docs/architecture.md, "The token-exact rule"): chat messages as
the template sees them (`messages.py`), matching keys and suffix rendering (`text.py`), a session's tree
of completions (`tree.py`), the trees held in memory (`index.py`), a call's prompt (`prompt.py`), and
which of an online key's sessions a call extends (`online.py`).

May import the proxy's kernel and storage, never the workers, recording or the APIs."""
