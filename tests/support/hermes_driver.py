"""Runs one hermes-agent conversation against an OpenAI-compatible base URL and prints the result as JSON.

Run with the hermes-agent venv's python (`.venv-agents/hermes`, built by `make agents`), never with the
project's: hermes-agent pins its own openai and friends. Only the standard library and hermes-agent are
imported here. Everything hermes-agent would persist goes under $HERMES_HOME / $HOME, which the test
points at a temporary directory; memory, context files, trajectories and checkpoints are off, and the
only tool offered is the in-memory `todo` list (no file system, shell or network).

    python hermes_driver.py --base-url http://127.0.0.1:8000/v1 --api-key sk-sess-... --model m "Hi"
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.metadata import version
from typing import Any


def run(base_url: str, api_key: str, model: str, message: str, toolsets: list[str]) -> dict[str, Any]:
    from run_agent import AIAgent  # hermes-agent's top-level module

    agent = AIAgent(
        base_url=base_url, api_key=api_key, model=model,
        enabled_toolsets=toolsets, max_iterations=4, tool_delay=0.0, quiet_mode=True,
        skip_memory=True, skip_context_files=True, save_trajectories=False, checkpoints_enabled=False,
    )
    result = agent.run_conversation(message)
    return {
        "final_response": result.get("final_response"),
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "error": result.get("error"),
        "api_calls": result.get("api_calls"),
        "messages": result.get("messages"),
        "tools": sorted(t["function"]["name"] for t in agent.tools or ()),
        # What the model probes (/api/v1/models, /api/show, /v1/models/{id}) told it.
        "context_length": getattr(agent.context_compressor, "context_length", None),
        "version": version("hermes-agent"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--toolsets", default="todo", help="comma-separated hermes-agent toolsets")
    parser.add_argument("message")
    args = parser.parse_args(argv)
    result = run(args.base_url, args.api_key, args.model, args.message, args.toolsets.split(","))
    # The last stdout line is the result; hermes-agent may print before it despite quiet_mode.
    sys.stdout.write("\n" + json.dumps(result, default=str) + "\n")


if __name__ == "__main__":
    main()
