"""`flywheel demo`: the whole loop on a math agent. Starts the stack (`flywheel up`), runs the GSM8K
agent as a separate process that knows only the proxy's URL and a key, and writes a report: the
reward curve, per-step metrics, and held-out accuracy before vs after training."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from flywheel.config import FlywheelConfig, load_config
from flywheel.report import read_metrics, write_report
from flywheel.stack import start_stack

# What the demo needs on a 2-core laptop, each applied only where the user's file, environment or
# overrides left the key at its default.
DEMO_DEFAULTS = {
    "serving.cpu.num_threads": "1",  # engine and trainer share 2 cores: one thread each
    "trainer.num_threads": "1",
    "trainer.lr": "1e-5",  # 3e-5 collapsed SmolLM2-135M to identical short answers in 20 steps
    "trainer.max_head_offpolicyness": "1",  # the agent's next round overlaps the trainer's step
    "proxy.finalizer.missing_reward": "drop",  # held-out evaluation sessions are never trained on
}


def demo_overrides(config_path: str | None, overrides: Sequence[str]) -> list[str]:
    """The user's overrides plus the demo's defaults and the trainer settings the run shape implies."""
    config = load_config(config_path, overrides)
    shape = config.demo
    implied = {
        **DEMO_DEFAULTS,
        "trainer.batch_size": str(shape.group_size * shape.problems_per_step),
        "trainer.total_steps": str(shape.steps),
        "trainer.ray.temp_dir": tempfile.mkdtemp(prefix="ray", dir="/tmp"),  # short socket paths
    }
    added = [f"{key}={value}" for key, value in implied.items() if not _is_set(config, key)]
    return [*added, *overrides]


def _is_set(config: Any, dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    for part in parents:
        config = getattr(config, part)
    return leaf in config.model_fields_set


def agent_command(config: FlywheelConfig, root_url: str, admin_key: str) -> list[str]:
    shape = config.demo
    command = [
        sys.executable, "-m", "integrations.gsm8k",
        "--base-url", root_url, "--api-key", admin_key,
        "--steps", str(shape.steps), "--group-size", str(shape.group_size),
        "--problems-per-step", str(shape.problems_per_step), "--eval-problems", str(shape.eval_problems),
        "--source", shape.source, "--difficulty", str(shape.difficulty), "--seed", str(shape.seed),
        "--temperature", str(shape.temperature), "--max-tokens", str(shape.max_tokens),
        "--concurrency", str(shape.concurrency),
        "--version-url", f"{root_url}/rl/v1/policy", "--version-lag", str(shape.version_lag),
        "--out", str(config.run.dir / "report"), "--progress",
    ]
    if shape.jsonl is not None:
        command += ["--jsonl", str(shape.jsonl)]
    return command


def run_demo(config_path: str | None, overrides: Sequence[str]) -> int:
    """Run the demo to the end; print the report's summary; the exit code of the agent."""
    overrides = demo_overrides(config_path, overrides)
    config = load_config(config_path, overrides)
    print(f"starting the stack (model {config.serving.model}; logs in {config.run.dir / 'logs'}) ...",
          flush=True)
    stack = asyncio.run(start_stack(config, config_path, overrides))
    try:
        print(f"proxy at {stack.root_url}/v1; the agent runs {config.demo.steps} rounds", flush=True)
        agent = subprocess.run(agent_command(config, stack.root_url, stack.admin_key), check=False)
    finally:
        stack.stop()
    report_dir = config.run.dir / "report"
    agent_report_path = report_dir / "agent_report.json"
    if agent.returncode != 0 or not agent_report_path.exists():
        logs = config.run.dir / "logs"
        print(f"the agent failed (exit {agent.returncode}); logs in {logs}", file=sys.stderr)
        return agent.returncode or 1
    agent_report = json.loads(agent_report_path.read_text())
    print(write_report(report_dir, read_metrics(config.run.dir / "metrics.jsonl"), agent_report))
    return 0
