"""The Codex CLI `config.toml` that sends every model call to a Flywheel proxy's Responses API, and the
command line that writes one: `python -m integrations.codex.config --base-url URL --model NAME`."""

from __future__ import annotations

import argparse
import json

PROVIDER = "flywheel"
KEY_ENV = "FLYWHEEL_KEY"


def config_toml(base_url: str, model: str, context_window: int | None = None) -> str:
    """Codex's config for a proxy at `base_url` (ending in `/v1`) serving `model`; the key is read from
    $FLYWHEEL_KEY. Update checks, analytics and the plugin catalogue's sync, which would reach
    openai.com and github.com, are off; the tools Codex offers are its defaults."""
    window = "" if context_window is None else f"model_context_window = {context_window}\n"
    return (
        f"model = {json.dumps(model)}\n"
        f"model_provider = {json.dumps(PROVIDER)}\n"
        f"{window}"
        "check_for_update_on_startup = false\n"
        "\n"
        f"[model_providers.{PROVIDER}]\n"
        'name = "Flywheel"\n'
        f"base_url = {json.dumps(base_url)}\n"
        f"env_key = {json.dumps(KEY_ENV)}\n"
        'wire_api = "responses"\n'
        "\n"
        "[analytics]\n"
        "enabled = false\n"
        "\n"
        "[features]\n"
        "plugins = false\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print a Codex CLI config.toml that uses a Flywheel proxy.")
    parser.add_argument("--base-url", required=True, help="the proxy's OpenAI base URL, e.g. http://host:8000/v1")
    parser.add_argument("--model", required=True, help="the served model's name, as GET /v1/models lists it")
    parser.add_argument("--context-window", type=int, help="the context max_model_len in /v1/models gives")
    args = parser.parse_args(argv)
    print(config_toml(args.base_url, args.model, args.context_window), end="")


if __name__ == "__main__":
    main()
