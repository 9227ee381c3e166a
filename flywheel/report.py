"""The demo's report: per-step metrics as JSON, a reward-curve PNG, and a short text summary."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import fmean
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The trainer's per-step metrics (JSON lines), oldest first; [] when it wrote none."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_report(out_dir: Path, metrics: list[dict[str, Any]], agent: dict[str, Any]) -> str:
    """Write metrics.json and reward_curve.png into `out_dir`; return the summary text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    plot_rewards(out_dir / "reward_curve.png", metrics, agent)
    return summarize(metrics, agent, out_dir)


def plot_rewards(path: Path, metrics: list[dict[str, Any]], agent: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    from matplotlib import pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4), dpi=120)
    rounds = agent.get("mean_reward_per_round") or []
    if rounds:
        axis.plot(range(1, len(rounds) + 1), rounds, "o-", label="agent: mean reward per round")
    if metrics:
        steps = [m["step"] for m in metrics]
        mean = [m["reward/mean"] for m in metrics]
        std = [m["reward/std"] for m in metrics]
        axis.plot(steps, mean, "s--", label="trainer: batch reward mean")
        axis.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                          [m + s for m, s in zip(mean, std, strict=True)], alpha=0.15)
    before, after = _accuracy(agent, "eval_before"), _accuracy(agent, "eval_after")
    title = "Flywheel demo: reward per training step"
    if before is not None and after is not None:
        title += f"\nheld-out accuracy {before:.1%} → {after:.1%}"
    axis.set(title=title, xlabel="round / policy version", ylabel="reward")
    axis.grid(alpha=0.3)
    axis.legend(loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def summarize(metrics: list[dict[str, Any]], agent: dict[str, Any], out_dir: Path) -> str:
    lines = []
    before, after = _accuracy(agent, "eval_before"), _accuracy(agent, "eval_after")
    if before is not None and after is not None:
        total = agent["eval_after"].get("total")
        lines.append(f"held-out accuracy: {before:.1%} before → {after:.1%} after ({total} problems)")
    rounds = agent.get("mean_reward_per_round") or []
    if len(rounds) >= 2:
        k = max(1, len(rounds) // 4)
        first, last = fmean(rounds[:k]), fmean(rounds[-k:])
        lines.append(f"mean reward: first {k} rounds {first:.3f} → last {k} rounds {last:.3f}")
    if metrics:
        generation = [r["seconds"] for r in agent.get("rounds", [])]
        train = [m.get("perf/train_s", 0.0) for m in metrics]
        push = [m.get("perf/weight_sync_s", 0.0) for m in metrics]
        lines.append(
            f"per step (mean): generation {fmean(generation) if generation else 0:.1f} s, "
            f"training {fmean(train):.1f} s, weight push (save + reload) {fmean(push):.2f} s; "
            f"{len(metrics)} steps, policy version {metrics[-1]['policy_version']}"
        )
    lines.append(f"report: {out_dir}/ (reward_curve.png, metrics.json, agent_report.json)")
    return "\n".join(lines)


def _accuracy(agent: dict[str, Any], phase: str) -> float | None:
    result = agent.get(phase)
    return None if not result else float(result["accuracy"])
