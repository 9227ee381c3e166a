"""OpenClaw's provider block for a Flywheel proxy, and writing it into an OpenClaw config file.

OpenClaw reads custom OpenAI-compatible providers from `models.providers` in its config
(`~/.openclaw/openclaw.json`, or the file `openclaw agent exec --config` names): `baseUrl` (OpenClaw
appends `/chat/completions`), `apiKey`, `api: "openai-completions"` and the models it may use. The
agent's default model is `agents.defaults.model.primary`, as `<provider>/<model id>`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from integrations.gsm8k.rl_api import root_url_of

PROVIDER = "flywheel"
DEFAULT_CONTEXT_WINDOW = 32_768
DEFAULT_MAX_TOKENS = 1024


class ConfigFileError(ValueError):
    """An existing OpenClaw config cannot be merged into (not a JSON object)."""


def openai_base_url(base_url: str) -> str:
    """The proxy's OpenAI base URL (ending in /v1) from its root or its base URL."""
    return f"{root_url_of(base_url)}/v1"


def provider_block(
    base_url: str, api_key: str, model: str, *, context_window: int = DEFAULT_CONTEXT_WINDOW,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> dict[str, Any]:
    """The `models.providers.<name>` entry that points OpenClaw at the proxy with `api_key`."""
    return {
        "baseUrl": openai_base_url(base_url),
        "apiKey": api_key,
        "api": "openai-completions",
        "models": [{"id": model, "name": f"{model} (Flywheel)", "contextWindow": context_window,
                    "maxTokens": max_tokens}],
    }


def merged_config(
    existing: dict[str, Any], block: dict[str, Any], model: str, provider: str = PROVIDER
) -> dict[str, Any]:
    """`existing` with the provider set to `block` (other providers and settings kept) and the agents'
    default model set to it."""
    config = copy.deepcopy(existing)
    models = config.setdefault("models", {})
    models.setdefault("mode", "merge")
    models.setdefault("providers", {})[provider] = block
    defaults = config.setdefault("agents", {}).setdefault("defaults", {})
    model_settings = defaults.get("model")
    if not isinstance(model_settings, dict):
        model_settings = defaults["model"] = {}
    model_settings["primary"] = f"{provider}/{model}"
    return config


def write_config(
    path: Path, base_url: str, api_key: str, model: str, *, context_window: int = DEFAULT_CONTEXT_WINDOW,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> dict[str, Any]:
    """Merge the proxy's provider block into the OpenClaw config at `path` (created if missing) and
    return the config written. The file holds a key: it is written readable by its owner only."""
    existing: Any = {}
    if path.exists() and path.read_text().strip():
        try:
            existing = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigFileError(
                f"{path} is not plain JSON ({exc}); write the block to a new file with --out and merge "
                "it by hand"
            ) from exc
        if not isinstance(existing, dict):
            raise ConfigFileError(f"{path} holds a JSON {type(existing).__name__}, not an object")
    block = provider_block(base_url, api_key, model, context_window=context_window, max_tokens=max_tokens)
    config = merged_config(existing, block, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return config
