"""`flywheel export` on a recorded run (tests/support/operated_run.py): what it writes loads with Hugging
Face `datasets` (`load_dataset("json" | "parquet", data_files=…)` and `load_dataset(DIR)`), every
per-token array reads back exactly as the database holds it (logprobs bit for bit as float32), and its
filters choose the rows they say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flywheel.cli import main
from storage.migrate import upgrade
from tests.support.cli import flywheel
from tests.support.databases import run_outside_loop, storage_overrides
from tests.support.operated_run import OperatedRun, StoredSample, record_operated_run_at, stored_samples

ALL = {"a-1", "a-2", "b-1", "b-2", "b-3"}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`datasets` reads local files only, and caches under tmp_path."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, OperatedRun]:
    """One SQLite database holding the operated run, shared by the module's filter cases."""
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('operated') / 'flywheel.db'}"
    run_outside_loop(upgrade, url)
    return url, record_operated_run_at(url)


def export(capsys: pytest.CaptureFixture[str], out: Path, *args: str) -> str:
    """`flywheel export --out OUT ARGS` in this process; its stdout (it must succeed)."""
    code = main(["export", "--out", str(out), *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def load(kind: str, target: str, cache: Path) -> Any:
    from datasets import load_dataset

    if kind == "dir":
        return load_dataset(target, split="train", cache_dir=str(cache))
    return load_dataset(kind, data_files=target, split="train", cache_dir=str(cache))


def assert_same_arrays(row: dict[str, Any], stored: StoredSample) -> None:
    """The row's per-token arrays are exactly the stored ones; logprobs compared as float32 bits."""
    assert row["trajectory_id"] == stored.trajectory_id
    assert np.array_equal(np.asarray(row["token_ids"], dtype=np.int64), stored.token_ids)
    assert np.array_equal(np.asarray(row["loss_mask"], dtype=bool), stored.loss_mask)
    assert np.array_equal(np.asarray(row["versions"], dtype=np.int64), stored.versions)
    logprobs = np.asarray(row["logprobs"], dtype=np.float64)
    assert np.array_equal(logprobs.astype(np.float32).astype(np.float64), logprobs)  # exactly a float32
    assert np.array_equal(logprobs.astype(np.float32).view(np.uint32), stored.logprobs.view(np.uint32))
    assert row["reward"] == stored.reward


def test_export_loads_with_datasets_and_round_trips_exactly(
    db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record_operated_run_at(db_url)
    stored = stored_samples(db_url)
    assert set(stored) == ALL
    db = storage_overrides(db_url)
    for fmt in ("jsonl", "parquet"):
        out = tmp_path / f"out-{fmt}"
        assert "exported 5 trajectories" in export(capsys, out, "--format", fmt, "--batch-rows", "2", *db)
        shards = sorted(path.name for path in (out / "data").iterdir())
        assert shards == [f"train-00000-of-00001.{fmt}"]
        for kind, target in [("json" if fmt == "jsonl" else "parquet", str(out / "data" / f"*.{fmt}")),
                             ("dir", str(out))]:
            rows = list(load(kind, target, tmp_path / "cache"))
            assert sorted(row["session_id"] for row in rows) == sorted(ALL)
            for row in rows:
                assert_same_arrays(row, stored[row["session_id"]])
        by_session = {row["session_id"]: row for row in load("dir", str(out), tmp_path / "cache")}
        b1 = by_session["b-1"]
        assert (b1["group_id"], b1["min_version"], b1["max_version"], b1["consumed_step"]) == (None, 1, 2, 2)
        assert json.loads(b1["task"]) == {"question": "task of b-1"}
        assert json.loads(b1["metadata"]) == {"run": "b"}
        assert (by_session["a-1"]["group_id"], by_session["b-3"]["consumed_step"]) == ("g-a", None)

    out = tmp_path / "filtered"  # the filters SQL applies (a JSON path for the run) and the one it cannot
    export(capsys, out, "--run", "b", "--min-version", "1", "--max-version", "2", *db)
    [shard] = (out / "data").iterdir()
    assert {json.loads(line)["session_id"] for line in shard.read_text().splitlines()} == {"b-1", "b-2"}


def test_export_shards_by_rows_as_a_subprocess(recorded: tuple[str, OperatedRun], tmp_path: Path) -> None:
    url, _ = recorded
    out = tmp_path / "dataset"
    result = flywheel("export", "--out", str(out), "--format", "parquet", "--shard-rows", "2",
                      f"storage.url={url}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = f"exported 5 trajectories (31 tokens) into 3 parquet shard(s) under {out / 'data'}"
    assert summary in result.stdout
    assert sorted(p.name for p in (out / "data").iterdir()) == [
        f"train-0000{i}-of-00003.parquet" for i in range(3)]
    dataset = load("dir", str(out), tmp_path / "cache")
    assert [row["session_id"] for row in dataset] == ["a-1", "a-2", "b-1", "b-2", "b-3"]
    assert str(dataset.features["logprobs"].feature.dtype) == "float32"  # the card's types, as written
    assert "5 trajectories (31 tokens)" in (out / "README.md").read_text()


@pytest.mark.parametrize(("args", "expected"), [
    ([], ALL),
    (["--run", "a"], {"a-1", "a-2"}),
    (["--run", "b"], {"b-1", "b-2", "b-3"}),
    (["--min-version", "1"], {"b-1", "b-2", "b-3"}),
    (["--max-version", "1"], {"a-1", "a-2"}),
    (["--min-version", "1", "--max-version", "2"], {"b-1", "b-2"}),  # b-3 has a version-3 token
    (["--min-version", "2", "--max-version", "2"], {"b-2"}),
    (["--min-reward", "0.5"], {"a-1", "b-1", "b-3"}),
    (["--consumed"], {"a-1", "a-2", "b-1"}),
    (["--unconsumed"], {"b-2", "b-3"}),
    (["--unconsumed", "--min-reward", "0", "--run", "b"], {"b-3"}),
    (["--since", "AFTER_B1"], {"b-2", "b-3"}),
    (["--until", "AFTER_B1"], {"a-1", "a-2", "b-1"}),
    (["--since", "1d", "--until", "2099-01-01"], ALL),
    (["--since", "2099-01-01"], set()),
])
def test_export_filters(
    recorded: tuple[str, OperatedRun], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    args: list[str], expected: set[str],
) -> None:
    url, run = recorded
    assert run.after_b1 is not None
    args = [run.after_b1.isoformat() if arg == "AFTER_B1" else arg for arg in args]
    out = tmp_path / "out"
    assert f"exported {len(expected)} trajectories" in export(capsys, out, *args, f"storage.url={url}")
    [shard] = (out / "data").iterdir()
    assert {json.loads(line)["session_id"] for line in shard.read_text().splitlines()} == expected


def test_export_keeps_an_earlier_export_unless_told(
    recorded: tuple[str, OperatedRun], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = recorded
    out = tmp_path / "out"
    export(capsys, out, "--shard-rows", "2", f"storage.url={url}")
    assert main(["export", "--out", str(out), "--run", "a", f"storage.url={url}"]) == 1
    assert "holds an earlier export" in capsys.readouterr().err
    assert len(list((out / "data").iterdir())) == 3
    export(capsys, out, "--run", "a", "--overwrite", f"storage.url={url}")
    assert [p.name for p in (out / "data").iterdir()] == ["train-00000-of-00001.jsonl"]
    assert "Filters: run=a" in (out / "README.md").read_text()
