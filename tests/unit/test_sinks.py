"""The trainer's experiment-tracking sinks, each read back with its own tool: TensorBoard event files
(EventAccumulator), a W&B offline run (its run file's records) and an MLflow run (MlflowClient). Each gets
the run config once and every step's finite metrics at step = trainer step, and ends with the run. A sink
configured without its library stops the trainer before it starts, saying what to install; one whose
service fails to open is left out and training goes on."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

from tests.support.metrics_readers import tensorboard_scalars, tensorboard_texts, wandb_config, wandb_history
from trainer.monitor import Monitor
from trainer.telemetry.base import TelemetryError
from trainer.telemetry.config import MlflowConfig, WandbConfig
from trainer.telemetry.sinks import TENSORBOARD_DIR, open_sinks
from trainer.telemetry.tensorboard_sink import CONFIG_TAG

SETTINGS = {"trainer": {"lr": 0.001, "algorithm": {"loss": {"clip_low": 0.2}}}, "model": "tiny"}
STEPS = {1: {"reward/mean": 0.25, "loss": 1.5}, 2: {"reward/mean": 0.5, "loss": float("inf")}}


def run_steps(monitor: Monitor) -> None:
    for step, metrics in STEPS.items():
        monitor.record(step, step, metrics)
    monitor.close()


def needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install 'flywheel-rl[tracking]')")


def test_tensorboard_event_files_hold_each_step_and_the_run_config(tmp_path: Path) -> None:
    sinks = open_sinks(tmp_path, SETTINGS, tensorboard=True)
    run_steps(Monitor(tmp_path / "metrics.jsonl", sinks))
    log_dir = tmp_path / TENSORBOARD_DIR
    scalars = tensorboard_scalars(log_dir)
    assert scalars["reward/mean"] == [(1, 0.25), (2, 0.5)]
    assert scalars["loss"] == [(1, 1.5)]  # the infinite loss of step 2 is left out, as in metrics.jsonl
    assert '"clip_low": 0.2' in tensorboard_texts(log_dir)[CONFIG_TAG]


@needs("wandb")
def test_wandb_offline_run_holds_each_step_and_the_run_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = WandbConfig(project="flywheel-test", mode="offline", tags=("unit",))
    run_steps(Monitor(None, open_sinks(tmp_path, SETTINGS, wandb=config)))
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = [(step, {k: v for k, v in row.items() if not k.startswith("_")})  # not W&B's own _step, _runtime
            for step, row in wandb_history(run_file)]
    assert rows == [(1, {"reward/mean": 0.25, "loss": 1.5}), (2, {"reward/mean": 0.5})]
    settings = wandb_config(run_file)
    assert settings["model"] == "tiny" and settings["trainer"]["algorithm"]["loss"]["clip_low"] == 0.2


@needs("mlflow")
def test_mlflow_run_holds_each_step_params_and_ends_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a database store migrates for seconds first
    uri = (tmp_path / "mlruns").as_uri()
    config = MlflowConfig(tracking_uri=uri, experiment="flywheel-test", run_name="unit", tags={"team": "rl"})
    sinks = open_sinks(tmp_path, SETTINGS, mlflow=config)
    run_id = sinks[0].run_id  # type: ignore[attr-defined]
    run_steps(Monitor(None, sinks))
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "unit" and run.data.tags["team"] == "rl"
    assert run.data.params["trainer.algorithm.loss.clip_low"] == "0.2" and run.data.params["model"] == "tiny"
    def history(key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]

    assert history("reward/mean") == [(1, 0.25), (2, 0.5)] and history("loss") == [(1, 1.5)]
    assert client.get_experiment(run.info.experiment_id).name == "flywheel-test"


@pytest.mark.parametrize("module", ["wandb", "mlflow"])
def test_a_tracker_configured_without_its_library_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    configured = {"wandb": WandbConfig(project="p", mode="offline")} if module == "wandb" else {
        "mlflow": MlflowConfig(tracking_uri=(tmp_path / "mlruns").as_uri())}
    with pytest.raises(TelemetryError, match=rf"trainer\.{module} is set but .*flywheel-rl\[tracking\]"):
        open_sinks(tmp_path, SETTINGS, tensorboard=True, **configured)  # type: ignore[arg-type]


@needs("mlflow")
def test_a_tracker_that_cannot_open_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = MlflowConfig(tracking_uri="no-such-scheme://nowhere")
    with caplog.at_level(logging.ERROR, logger="trainer.telemetry.sinks"):
        sinks = open_sinks(tmp_path, SETTINGS, tensorboard=True, mlflow=config)
    assert [sink.name for sink in sinks] == ["tensorboard"]
    assert "MLflow logging could not start; training goes on without it" in caplog.text
    Monitor(None, sinks).close()
