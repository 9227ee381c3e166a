"""`flywheel rewards hooks` lists the built-in hooks; a configured hook that cannot be used stops
`flywheel proxy` and `flywheel rewards run` at once, with the nearest valid name, before they serve."""

from __future__ import annotations

from pathlib import Path

from tests.support.cli import flywheel


def test_rewards_hooks_lists_every_built_in_hook(tmp_path: Path) -> None:
    result = flywheel("rewards", "hooks", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    names = {line.split()[0] for line in result.stdout.splitlines() if line and not line.startswith("A ")}
    assert {"math", "exact", "regex", "json_schema", "code_tests", "webhook", "group_webhook", "judge",
            "group_ranking", "next_state"} <= names


def test_a_misnamed_configured_hook_stops_the_proxy_and_the_runner(tmp_path: Path) -> None:
    overrides = [f"run.dir={tmp_path / 'run'}", 'rewards.hooks=[{"hook": "mathh"}]']
    for command in (["proxy"], ["rewards", "run"]):
        result = flywheel(*command, *overrides, cwd=tmp_path, timeout=120)
        assert result.returncode == 2, (command, result.stderr)
        assert "unknown reward hook 'mathh': did you mean 'math'?" in result.stderr
        assert "Traceback" not in result.stderr
