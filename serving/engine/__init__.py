"""The built-in CPU serving engine: transformers on torch, continuous batching, SGLang 0.5.23's native
HTTP protocol (`/generate`, weight updates, pause/continue). Entry points live in `serving.engine.server`."""
