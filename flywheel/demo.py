"""`flywheel demo`: the whole loop on a math agent. Starts the stack (`flywheel up`), runs the GSM8K
agent as a separate process that knows only the proxy's URL and a key, and writes a report: the
reward curve, per-step metrics, and held-out accuracy before vs after training.

On a terminal two bars show where it is (stderr; flywheel/progress.py): the stack's start-up phases, then
the trainer's steps out of `demo.steps`, read from the run's metrics.jsonl with the last step's batch
reward. The agent draws no bar of its own: two processes cannot share one terminal line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flywheel.config import FlywheelConfig, load_config
from flywheel.progress import PhaseBar, progress_bar
from flywheel.report import read_metrics, write_report
from flywheel.stack import start_stack, startup_phases

if TYPE_CHECKING:
    from tqdm import tqdm

# What the demo needs on a 2-core laptop, each applied only where the user's file, environment or
# overrides left the key at its default.
DEMO_DEFAULTS = {
    "serving.cpu.num_threads": "1",  # engine and trainer share 2 cores: one thread each
    "trainer.num_threads": "1",
    "trainer.lr": "1e-5",  # 3e-5 collapsed SmolLM2-135M to identical short answers in 20 steps
    "trainer.max_head_offpolicyness": "1",  # the agent's next round overlaps the trainer's step
    "proxy.finalizer.missing_reward": "drop",  # held-out evaluation sessions are never trained on
}


# AReaL's GSM8K GRPO quickstart (examples/math/gsm8k_grpo.yaml) on our keys, for a like-for-like run on a
# GPU: Qwen2.5-1.5B-Instruct served by SGLang, 4 samples per problem, 1024 new tokens, lr 1.7e-5,
# eps_clip 0.4, η = 2, temperature 1.0; its batch of 256 problems.
GPU_RUN = {
    "serving.backend": "sglang",
    "serving.model": "Qwen/Qwen2.5-1.5B-Instruct",
    "demo.group_size": "4",
    "demo.problems_per_step": "256",
    "demo.max_tokens": "1024",
    "demo.temperature": "1.0",
    "trainer.lr": "1.7e-5",
    "trainer.algorithm.loss.eps_clip": "0.4",
    "trainer.max_head_offpolicyness": "2",
}


def gpu_present() -> bool:
    """Whether this machine can run the GPU flagship: CUDA for torch and sglang installed."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:  # asked first: no torch import where it cannot be
        return False
    import torch

    return bool(torch.cuda.is_available())


def resolved_hardware(config: FlywheelConfig) -> str:
    """The flagship run the demo makes here: the configured `demo.hardware`, "auto" resolved."""
    if config.demo.hardware != "auto":
        return config.demo.hardware
    return "gpu" if gpu_present() else "cpu"


def demo_overrides(config_path: str | None, overrides: Sequence[str]) -> list[str]:
    """The user's overrides plus the flagship run's settings (the GPU run's, on a GPU), the demo's
    defaults and the trainer settings the run shape implies; each only where the user left it unset."""
    config = load_config(config_path, overrides)
    if resolved_hardware(config) == "gpu":
        added = [f"{key}={value}" for key, value in GPU_RUN.items() if not _is_set(config, key)]
        overrides = [*added, *overrides]
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
        "--out", str(config.run.dir / "report"),
    ]
    if shape.jsonl is not None:
        command += ["--jsonl", str(shape.jsonl)]
    return command


@dataclass(frozen=True, slots=True)
class TrainingProgress:
    """Where the trainer is, from metrics.jsonl: its last step and that step's batch reward mean."""

    step: int = 0
    reward: float | None = None


def training_progress(metrics: Path) -> TrainingProgress:
    """The last complete line of the trainer's metrics.jsonl (a line being written is skipped); nothing
    yet when there is no file."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return TrainingProgress()
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            reward = row.get("reward/mean")
            return TrainingProgress(row["step"], float(reward) if isinstance(reward, int | float) else None)
    return TrainingProgress()


def show_training(bar: tqdm[Any], progress: TrainingProgress) -> None:
    """Move `bar` to the trainer's step (never back, never past its total) with its reward."""
    step = progress.step if bar.total is None else min(progress.step, int(bar.total))
    if step > bar.n:
        if progress.reward is not None:
            bar.set_postfix(reward=f"{progress.reward:.3f}", refresh=False)
        bar.update(step - bar.n)


def follow_training(
    agent: subprocess.Popen[bytes], metrics: Path, bar: tqdm[Any], poll_s: float = 1.0
) -> int:
    """Wait for the agent, moving `bar` with the trainer's steps every `poll_s` seconds; its exit status.
    Interrupted (Ctrl-C, SIGTERM), the agent is killed."""
    try:
        while True:
            try:
                code: int | None = agent.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                code = None
            show_training(bar, training_progress(metrics))
            if code is not None:
                return code
    except BaseException:
        agent.kill()
        agent.wait()
        raise


def run_demo(config_path: str | None, overrides: Sequence[str], *, progress: bool | None = None) -> int:
    """Run the demo to the end; print the report's summary; the exit code of the agent. `progress`: the
    bars on stderr (None: only on a terminal)."""
    overrides = demo_overrides(config_path, overrides)
    config = load_config(config_path, overrides)
    print(f"starting the stack ({resolved_hardware(config)} run: model {config.serving.model} on "
          f"{config.serving.backend}; logs in {config.run.dir / 'logs'}) ...", flush=True)
    with progress_bar(startup_phases(config), desc="start-up", unit="phase", enabled=progress) as bar:
        phases = PhaseBar(bar)
        stack = asyncio.run(start_stack(config, config_path, overrides, on_phase=phases))
        phases.finish()
    try:
        print(f"proxy at {stack.root_url}/v1; the agent runs {config.demo.steps} rounds", flush=True)
        command = agent_command(config, stack.root_url, stack.admin_key)
        with progress_bar(config.demo.steps, desc="training", unit="step", enabled=progress) as bar:
            returncode = follow_training(subprocess.Popen(command), config.run.dir / "metrics.jsonl", bar)
    finally:
        stack.stop()
    report_dir = config.run.dir / "report"
    agent_report_path = report_dir / "agent_report.json"
    if returncode != 0 or not agent_report_path.exists():
        logs = config.run.dir / "logs"
        print(f"the agent failed (exit {returncode}); logs in {logs}", file=sys.stderr)
        return returncode or 1
    agent_report = json.loads(agent_report_path.read_text())
    print(write_report(report_dir, read_metrics(config.run.dir / "metrics.jsonl"), agent_report))
    return 0
