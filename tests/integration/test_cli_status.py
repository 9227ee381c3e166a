"""`flywheel status` and `flywheel sessions list|show` on a recorded run (tests/support/operated_run.py):
the numbers they print as JSON match what was written, and the text is an aligned table."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from flywheel.cli import main
from flywheel.cli_support import parse_moment
from storage.migrate import upgrade
from tests.support.answering_proxy import answering_proxy
from tests.support.databases import run_outside_loop, storage_overrides
from tests.support.operated_run import OperatedRun, record_operated_run_at


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, OperatedRun]:
    """One SQLite database holding the operated run, shared by the module's read-only tests."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('operated') / 'flywheel.db'}"
    run_outside_loop(upgrade, url)
    return url, record_operated_run_at(url)


def flywheel_out(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run `flywheel ARGS` in this process; its stdout (it must succeed)."""
    code = main(list(args))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def flywheel_json(capsys: pytest.CaptureFixture[str], *args: str) -> Any:
    return json.loads(flywheel_out(capsys, *args, "--json"))


def status_rows(text: str) -> dict[str, str]:
    """`flywheel status`'s table by its WHAT column (the header's columns fix where each starts)."""
    header, *lines = text.splitlines()
    assert header.split() == ["SECTION", "WHAT", "VALUE"]
    what, value = header.index("WHAT"), header.index("VALUE")
    return {line[what:value].strip(): line[value:] for line in lines}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default run directory (run.dir) is relative


def test_status_counts_what_waits_and_what_was_trained(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    record_operated_run_at(db_url)
    status = flywheel_json(capsys, "status", *storage_overrides(db_url))  # sqlite and postgres

    policy = status["policy"]
    assert (policy["newest"]["version"], policy["newest"]["status"]) == (2, "rejected")
    assert (policy["served"]["version"], policy["served"]["eval_score"]) == (1, 0.125)
    assert (policy["best"]["version"], policy["best"]["eval_score"]) == (0, 0.25)
    assert policy["versions"] == {"candidate": 0, "promoted": 2, "rejected": 1}
    trainer = status["trainer"]
    assert (trainer["steps"], trainer["last_step"], trainer["last_step_version"]) == (2, 2, 2)
    assert trainer["last_metrics"] == {"loss": 0.25}
    assert datetime.fromisoformat(trainer["last_step_at"]) <= datetime.now(UTC)
    assert status["queues"] == {
        "sessions_active": 1, "sessions_ended": 1, "trajectories_unconsumed": 2, "trajectories_claimed": 1,
        "reward_jobs": {"queued": 1, "running": 0, "done": 0, "failed": 0},
    }
    totals = status["totals"]
    assert {k: v for k, v in totals.items() if k != "last_completion_at"} == {
        "sessions": 7, "sessions_finalized": 5, "groups": 1, "completions": 6, "trajectories": 5,
        "trajectories_consumed": 3, "trajectories_dropped": 0,
    }
    assert "proxy" not in status

    db = storage_overrides(db_url)
    listed = flywheel_json(capsys, "sessions", "list", "--run", "a", "--state", "finalized", *db)
    assert [(s["session_id"], s["completions"], s["output_tokens"]) for s in listed] == [
        ("a-2", 1, 3), ("a-1", 1, 3)]


def test_status_table_reads_as_aligned_rows(
    recorded: tuple[str, OperatedRun], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = recorded
    text = flywheel_out(capsys, "status", f"storage.url={url}")
    assert text.splitlines()[1].split()[:3] == ["policy", "newest", "trained"]
    rows = status_rows(text)
    assert rows["newest trained"] == "v2 rejected, eval 0.1"
    assert rows["served"].startswith("v1 promoted, eval 0.125, served since ")
    assert rows["best"] == "v0 promoted, eval 0.25"
    assert rows["unconsumed trajectories"] == "2 (1 claimed)"
    assert rows["reward hook jobs"] == "1 queued, 0 running, 0 done, 0 failed"
    assert rows["sessions"] == "7 (5 finalized)"
    assert rows["trajectories"] == "5 (3 consumed, 0 dropped as stale)"
    assert rows["last step"].startswith("step 2 → v2 at ")


def test_status_asks_the_proxy_with_the_run_admin_key(
    recorded: tuple[str, OperatedRun], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url, _ = recorded
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "admin_key").write_text("fw-admin-test\n")
    with answering_proxy("fw-admin-test", model="tiny-model", policy_version=1) as proxy:
        status = flywheel_json(capsys, "status", "--proxy", proxy.url, f"storage.url={url}",
                               f"run.dir={run_dir}")
        text = flywheel_out(capsys, "status", "--proxy", proxy.url, "--proxy-key", "wrong",
                            f"storage.url={url}")
    assert status["proxy"] == {"url": proxy.url, "healthy": True, "error": None, "model": "tiny-model",
                               "max_model_len": 512, "policy_version": 1}
    assert "Bearer fw-admin-test" in proxy.keys_seen
    rows = status_rows(text)  # a wrong key: its health only
    assert (rows["url"], rows["health"]) == (proxy.url, "ok")
    assert "served model" not in rows

    down = flywheel_json(capsys, "status", "--proxy", proxy.url, f"storage.url={url}")["proxy"]
    assert down["healthy"] is False and "ConnectError" in down["error"]


def test_sessions_list_filters_and_measures(
    recorded: tuple[str, OperatedRun], capsys: pytest.CaptureFixture[str]
) -> None:
    url, run = recorded
    db = f"storage.url={url}"
    listed = flywheel_json(capsys, "sessions", "list", db)
    assert [s["session_id"] for s in listed] == ["a-4", "a-3", "b-3", "b-2", "b-1", "a-2", "a-1"]
    by_id = {s["session_id"]: s for s in listed}
    assert {k: by_id["b-1"][k] for k in ("status", "run", "completions", "output_tokens", "trajectories",
                                         "reward")} == {
        "status": "finalized", "run": "b", "completions": 3, "output_tokens": 6, "trajectories": 1,
        "reward": 0.75,
    }
    assert (by_id["a-1"]["group_id"], by_id["a-1"]["reward"]) == ("g-a", None)
    assert by_id["a-3"]["status"] == "active"

    def ids(*args: str) -> list[str]:
        return [s["session_id"] for s in flywheel_json(capsys, "sessions", "list", *args, db)]

    assert ids("--state", "finalized") == ["b-3", "b-2", "b-1", "a-2", "a-1"]
    assert ids("--state", "ended") == ["a-4"]
    assert ids("--run", "a") == ["a-4", "a-3", "a-2", "a-1"]
    assert ids("--run", "a", "--state", "active") == ["a-3"]
    assert ids("--limit", "2") == ["a-4", "a-3"]
    assert run.after_b1 is not None
    assert ids("--since", run.after_b1.isoformat()) == ["a-4", "a-3", "b-3", "b-2"]
    assert ids("--run", "nobody") == []

    table = flywheel_out(capsys, "sessions", "list", "--run", "b", db).splitlines()
    assert table[0].split() == ["SESSION", "STATUS", "GROUP", "RUN", "CREATED", "(UTC)", "CALLS", "OUT",
                                "TOKENS", "REWARD", "SAMPLES"]
    b1 = table[3].split()
    assert (b1[0], b1[1], b1[-4:]) == ("b-1", "finalized", ["3", "6", "0.75", "1"])


def test_sessions_show_draws_the_completion_tree(
    recorded: tuple[str, OperatedRun], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = recorded
    db = f"storage.url={url}"
    shown = flywheel_json(capsys, "sessions", "show", "b-1", db)
    assert shown["reward"] == {"session": 0.5, "completions": {"b-1-c2": 0.25}, "total": 0.75}
    assert [(c["id"], c["parent_id"], c["depth"], c["prompt_tokens"], c["completion_tokens"],
             c["finish_reason"], c["versions"], c["reward"]) for c in shown["completions"]] == [
        ("b-1-c1", None, 0, 4, 2, "stop", [1], None),
        ("b-1-c2", "b-1-c1", 1, 4 + 2 + 2, 3, "stop", [2], 0.25),
        ("b-1-c3", "b-1-c1", 1, 4 + 2 + 1, 1, "length", [2], None),
    ]
    assert [(r["completion_id"], r["source"], r["value"]) for r in shown["rewards"]] == [
        (None, "rest", 0.5), ("b-1-c2", "rest", 0.25)]
    assert [(t["tokens"], t["trained_tokens"], t["reward"], t["min_version"], t["consumed_step"])
            for t in shown["trajectories"]] == [(11, 5, 0.75, 1, 2)]

    text = flywheel_out(capsys, "sessions", "show", "b-1", db)
    tree = [line.split()[:2] for line in text.splitlines() if "b-1-c" in line and "rest" not in line]
    assert tree == [["b-1-c1", "4"], ["├─", "b-1-c2"], ["└─", "b-1-c3"]]
    assert "consumed by step 2" in text

    hooks = flywheel_json(capsys, "sessions", "show", "a-4", db)["hooks"]
    assert [(h["level"], h["source"], h["state"], h["attempts"], h["max_attempts"]) for h in hooks] == [
        ("session", "hook:math", "queued", 0, 3)]
    assert "hook:math  session  queued  0/3" in flywheel_out(capsys, "sessions", "show", "a-4", db)

    assert main(["sessions", "show", "nobody", db]) == 1
    assert "no session 'nobody'" in capsys.readouterr().err


def test_a_missing_sqlite_database_is_named_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "elsewhere" / "flywheel.db"
    assert main(["status", f"storage.url=sqlite+aiosqlite:///{path}"]) == 1
    assert f"no database at {path}" in capsys.readouterr().err
    assert not path.exists()


def test_times_are_read_as_iso_or_as_a_time_ago() -> None:
    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert parse_moment("90m", now) == now - timedelta(minutes=90)
    assert parse_moment("2d", now) == now - timedelta(days=2)
    assert parse_moment("2026-04-30") == datetime(2026, 4, 30, tzinfo=UTC)
    assert parse_moment("2026-04-30T10:00:00+02:00") == datetime(2026, 4, 30, 8, tzinfo=UTC)
    with pytest.raises(argparse.ArgumentTypeError, match="not a time"):
        parse_moment("yesterday")
