"""The OpenAI-compatible proxy: it serves every agent call through the workers and records each
completion token-exactly before answering.

Folders, top to bottom; a folder imports only from those below it (checked by `lint-imports`, see
pyproject.toml and docs/architecture.md, "Layers and folders"):

- `server.py`, `app.py`: uvicorn and the FastAPI app (routes, middleware, the lifespan).
- `openai/`: the OpenAI surface: routes, the one call pipeline, chat, legacy completions, the
  Responses API, streaming. `rl/`: the RL control API (sessions, groups, rewards, ends). The two never
  import each other.
- `services.py`: every stateful part, built once per app and never changed afterwards.
- `recording/`: the completion recorder (group commit) and the records of a call.
- `conversations/`: token-exact multi-turn prompts (message keys, session trees, the index, prompt
  building, online keys' session matching). `workers/`: routing, generation plans, calls with failover,
  resumption after weight pushes. The two never import each other.
- The kernel: `sessions.py`, `request_context.py`, `hot_routes.py`; `auth.py`, `tokenize.py`,
  `config.py`, `metrics.py`; `parsers/`, `errors.py`.
"""
