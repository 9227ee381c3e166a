"""Progress bars of the long `flywheel` commands: on stderr only, drawn on a terminal (or when forced), each
counting its units: completions purged by `db purge-json`, the demo's start-up phases and trainer steps,
the steps of a GGUF conversion. Commands whose stdout is data keep it clean with a bar drawn."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.cli import main
from flywheel.config import load_config
from flywheel.demo import TrainingProgress, follow_training, training_progress
from flywheel.progress import PhaseBar, progress_bar
from flywheel.purge_json import purge_json
from serving.models import gguf_convert
from storage.migrate import upgrade
from tests.support.databases import run_outside_loop, storage_overrides
from tests.support.operated_run import record_operated_run_at


class Terminal(io.StringIO):
    """A stderr that says it is a terminal, so that bars left to decide (`disable=None`) are drawn."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def operated_db(tmp_path: Path) -> str:
    """A SQLite database holding tests/support/operated_run.py's run."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    run_outside_loop(upgrade, url)
    record_operated_run_at(url)
    return url


def test_a_bar_is_drawn_on_a_terminal_or_when_forced_and_counts_its_units() -> None:
    shown = io.StringIO()
    with progress_bar(3, desc="work", unit="item", enabled=True, file=shown) as bar:
        for _ in range(3):
            bar.update(1)
    assert "work" in shown.getvalue() and "3/3" in shown.getvalue()
    assert progress_bar(3, desc="work", unit="item", file=io.StringIO()).disable  # a file: no bar
    assert progress_bar(3, desc="work", unit="item", enabled=False, file=Terminal()).disable
    assert not progress_bar(3, desc="work", unit="item", file=Terminal()).disable


def test_purge_json_counts_the_completions_it_purges_batch_by_batch(
    operated_db: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_config(None, [*storage_overrides(operated_db), "proxy.privacy.purge_batch=2"])
    assert purge_json(config, 0.0, progress=True) == 0
    captured = capsys.readouterr()
    purged = int(captured.out.split()[5])
    assert captured.out == f"purged the raw JSON of {purged} completion(s)\n"
    assert purged > 2  # more than one batch
    assert f"{purged}/{purged}" in captured.err


def test_stdout_stays_data_while_bars_draw_on_a_terminal(
    operated_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = storage_overrides(operated_db)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["export", "--out", str(tmp_path / "out"), "--batch-rows", "2", *db]) == 0
    out = capsys.readouterr().out
    assert out.startswith("exported ") and out.count("\n") == 1
    assert "export" in terminal.getvalue() and "rows" in terminal.getvalue()  # the bar went to stderr
    assert main(["status", "--json", *db]) == 0
    assert isinstance(json.loads(capsys.readouterr().out), dict)  # all of stdout is one JSON document


def test_the_demo_s_start_up_bar_counts_each_phase_once_the_next_begins() -> None:
    shown = io.StringIO()
    with progress_bar(3, desc="start-up", unit="phase", enabled=True, file=shown) as bar:
        phases = PhaseBar(bar)
        for name in ("migrate the database", "prepare the model", "start the proxy"):
            phases(name)
        assert bar.n == 2 and "start the proxy" in shown.getvalue()
        phases.finish()
        assert bar.n == 3


def test_training_progress_is_the_last_complete_metrics_line(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    assert training_progress(metrics) == TrainingProgress()
    metrics.write_text(json.dumps({"step": 1, "reward/mean": 0.25}) + "\n"
                       + json.dumps({"step": 2, "reward/mean": 0.5}) + "\n" + '{"step": 3, "rew')
    assert training_progress(metrics) == TrainingProgress(2, 0.5)


def test_the_demo_s_training_bar_follows_the_trainer_s_steps_until_the_agent_exits(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    writes_steps = (
        "import json, sys, time\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    for step in (1, 2, 3):\n"
        "        f.write(json.dumps({'step': step, 'reward/mean': step / 4}) + '\\n'); f.flush()\n"
        "        time.sleep(0.05)\n"
        "sys.exit(3)\n"
    )
    shown = io.StringIO()
    agent = subprocess.Popen([sys.executable, "-c", writes_steps, str(metrics)])
    with progress_bar(3, desc="training", unit="step", enabled=True, file=shown) as bar:
        assert follow_training(agent, metrics, bar, poll_s=0.02) == 3  # the agent's exit status
        assert bar.n == 3
    assert "3/3" in shown.getvalue() and "reward=0.750" in shown.getvalue()


class _Saved:
    """A stand-in for a converted model or tokenizer: `save_pretrained` writes a marker file."""

    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, out_dir: Path) -> None:
        (Path(out_dir) / self.name).write_text("saved")


def test_a_gguf_conversion_counts_its_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gguf_convert, "load_gguf_tokenizer", lambda path: _Saved("tokenizer"))
    monkeypatch.setattr(gguf_convert, "load_gguf_model", lambda path, dtype=None: _Saved("model"))
    out = gguf_convert.convert_gguf(tmp_path / "model.gguf", tmp_path / "out", progress=True)
    assert sorted(path.name for path in out.iterdir()) == ["model", "tokenizer"]
    err = capsys.readouterr().err
    assert "convert model.gguf" in err and "3/3" in err
