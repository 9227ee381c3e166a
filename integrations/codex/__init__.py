"""OpenAI's Codex CLI (npm `@openai/codex` 0.169.0) on Flywheel: `config.py` writes the `config.toml` that
points Codex at the proxy's Responses API. See README.md here."""
