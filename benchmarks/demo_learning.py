"""Does the demo learn? Runs `flywheel demo` (SmolLM2-135M-Instruct on the CPU engine, the GSM8K
agent, the Ray trainer) for a fixed budget, `--runs` times, and prints held-out accuracy before and
after each run and the wall time per step split into generation, training and weight push.

    .venv/bin/python benchmarks/demo_learning.py [--runs 2] [--steps 20] [key.sub=value ...]

Extra arguments are config overrides passed to every run (for example `demo.group_size=8`). Each run
uses its own run directory under --out and fresh ports; the model cache is shared.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import fmean, median

from serving.threaded_server import free_port


def run_once(index: int, args: argparse.Namespace, overrides: list[str]) -> dict:
    run_dir = Path(args.out) / f"run-{index}"
    command = [
        sys.executable, "-m", "flywheel.cli", "demo", f"run.dir={run_dir}",
        f"serving.port={free_port()}", f"proxy.port={free_port()}", f"demo.steps={args.steps}",
        f"demo.seed={index}", *overrides,
    ]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"run {index} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    report = run_dir / "report"
    agent = json.loads((report / "agent_report.json").read_text())
    metrics = json.loads((report / "metrics.json").read_text())
    return {"agent": agent, "metrics": metrics, "wall_s": wall, "dir": str(report)}


def row(index: int, run: dict) -> str:
    agent, metrics = run["agent"], run["metrics"]
    rounds = agent["mean_reward_per_round"]
    k = max(1, len(rounds) // 4)
    generation = [r["seconds"] for r in agent["rounds"]]
    train = [m["perf/train_s"] for m in metrics]
    push = [m["perf/weight_sync_s"] for m in metrics]
    cells = [
        f"{index}",
        f"{agent['eval_before']['accuracy']:.1%}",
        f"{agent['eval_after']['accuracy']:.1%}",
        f"{fmean(rounds[:k]):.3f} → {fmean(rounds[-k:]):.3f}",
        f"{len(metrics)}",
        f"{fmean(generation):.1f}",
        f"{fmean(train):.1f}",
        f"{median(push):.2f} (max {max(push):.2f})",
        f"{run['wall_s'] / 60:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="flywheel-run/bench-demo-learning")
    args, overrides = parser.parse_known_args()
    runs = [run_once(index, args, overrides) for index in range(args.runs)]
    eval_n = runs[0]["agent"]["eval_before"]["total"]
    print(f"\nflywheel demo, {args.steps} steps per run, held-out problems: {eval_n}, overrides: {overrides}")
    print("| run | accuracy before | accuracy after | mean reward first → last quarter | steps "
          "| generation s/step | training s/step | weight push s (median) | wall min |")
    print("|---|---|---|---|---|---|---|---|---|")
    for index, run in enumerate(runs):
        print(row(index, run))
    print("reports:", ", ".join(run["dir"] for run in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
