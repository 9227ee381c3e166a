"""The demo report: metrics JSON, a reward-curve PNG, and a summary with the numbers that matter."""

import json

from flywheel.report import read_metrics, write_report


def test_report_files_and_summary(tmp_path):
    metrics_path = tmp_path / "metrics.jsonl"
    steps = [
        {"step": i, "policy_version": i, "reward/mean": 0.1 * i, "reward/std": 0.05,
         "perf/train_s": 2.0, "perf/weight_sync_s": 0.5}
        for i in range(1, 5)
    ]
    metrics_path.write_text("".join(json.dumps(step) + "\n" for step in steps))
    agent = {
        "eval_before": {"accuracy": 0.1, "total": 20},
        "eval_after": {"accuracy": 0.35, "total": 20},
        "mean_reward_per_round": [0.1, 0.2, 0.3, 0.5],
        "rounds": [{"seconds": 4.0}] * 4,
    }
    out = tmp_path / "report"
    summary = write_report(out, read_metrics(metrics_path), agent)
    assert "held-out accuracy: 10.0% before → 35.0% after (20 problems)" in summary
    assert "first 1 rounds 0.100 → last 1 rounds 0.500" in summary
    assert "generation 4.0 s, training 2.0 s, weight push (save + reload) 0.50 s; 4 steps" in summary
    assert json.loads((out / "metrics.json").read_text()) == steps
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_metrics_file_is_empty(tmp_path):
    assert read_metrics(tmp_path / "none.jsonl") == []
