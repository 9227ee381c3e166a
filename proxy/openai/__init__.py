"""The OpenAI surface: `routes.py` mounts chat completions, legacy completions and the Responses API on
the one call pipeline (`pipeline.py`); each API supplies only request → plan and results → response
(`chat.py`, `completions.py`, `responses/`); `streaming.py` relays a worker's stream and records it.

May import the proxy's services and everything below them, never `proxy.rl`."""
