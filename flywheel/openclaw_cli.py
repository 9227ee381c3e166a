"""`flywheel openclaw config`: point an OpenClaw install at this Flywheel's proxy by writing the provider
block into its config (integrations/openclaw/config.py), with a key given or a new online key."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flywheel.config import FlywheelConfig
from integrations.gsm8k.rl_api import FlywheelAPIError, RLClient
from integrations.openclaw.config import (
    DEFAULT_CONTEXT_WINDOW,
    DEFAULT_MAX_TOKENS,
    ConfigFileError,
    write_config,
)

DEFAULT_OPENCLAW_CONFIG = Path("~/.openclaw/openclaw.json")


def add_openclaw_parser(command: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The `openclaw` command's actions, added to `command` (returned: the config overrides follow them)."""
    actions = command.add_subparsers(dest="action", required=True, metavar="ACTION")
    config = actions.add_parser(
        "config", help="write the provider block for this proxy into an OpenClaw config",
        description="merge a `flywheel` provider (this proxy's URL, a key, the served model) into an "
                    "OpenClaw config file and make it the agents' default model",
    )
    key = config.add_mutually_exclusive_group(required=True)
    key.add_argument("--key", help="the key OpenClaw sends (a session or online key)")
    key.add_argument("--online", action="store_true",
                     help="create a new online key for it: each conversation becomes a session")
    config.add_argument("--out", type=Path, default=DEFAULT_OPENCLAW_CONFIG,
                        help="the OpenClaw config file to merge into (default: %(default)s)")
    config.add_argument("--base-url", default=None,
                        help="the proxy's URL as OpenClaw reaches it (default: proxy.public_base_url, "
                             "else proxy.host and proxy.port)")
    config.add_argument("--model", default=None,
                        help="the served model's name (default: the proxy's, else serving.served_model_name "
                             "or serving.model)")
    config.add_argument("--context-window", type=int, default=None,
                        help="the model's context in tokens (default: the proxy's, else "
                             f"{DEFAULT_CONTEXT_WINDOW}); OpenClaw compacts the history as it nears this")
    config.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="OpenClaw's max_completion_tokens per call (default: %(default)s)")
    return [config]


def run_openclaw(config: FlywheelConfig, args: argparse.Namespace, new_online_key: Callable[[], str]) -> int:
    """Write the provider block; `new_online_key` makes the key when `--online` asks for one."""
    key = new_online_key() if args.online else args.key
    base_url = args.base_url or config.proxy.base_url().replace("//0.0.0.0:", "//127.0.0.1:")
    served = _served_model(base_url, key)
    model = args.model or served.get("id") or config.serving.served_model_name or config.serving.model
    context_window = args.context_window or served.get("max_model_len") or DEFAULT_CONTEXT_WINDOW
    path = args.out.expanduser()
    try:
        write_config(path, base_url, key, model, context_window=int(context_window),
                     max_tokens=args.max_tokens)
    except ConfigFileError as exc:
        print(f"flywheel: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the `flywheel` provider ({base_url}, model {model}, {context_window} tokens) into {path}")
    if args.online:
        print("the online key (also in that file):", key)
    return 0


def _served_model(base_url: str, key: str) -> dict[str, Any]:
    """The proxy's model entry (`id`, `max_model_len`) if the proxy answers now; empty if not (it need not
    be running: the config's values are used then)."""
    try:
        with RLClient(base_url, key, timeout_s=5) as client:
            return client.served_model_entry()
    except FlywheelAPIError:
        return {}
