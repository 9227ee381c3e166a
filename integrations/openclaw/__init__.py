"""OpenClaw (npm `openclaw`) trained through Flywheel, its code untouched: it only gets a provider block
naming the proxy's URL, a key and the served model.

- `config`: the provider block, merged into an OpenClaw config file (`flywheel openclaw config`).
- `driver`: headless tasks run with the real CLI (`openclaw agent exec`), one session per task, graded by
  a reward hook when the session ends.
- `cli`: `python -m integrations.openclaw tasks|feedback`.
"""
