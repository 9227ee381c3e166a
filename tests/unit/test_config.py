"""Config layering: YAML, then FLYWHEEL_* env, then key.sub=value overrides; unknown keys are errors."""

from pathlib import Path

import pytest

from flywheel.cli import main
from flywheel.config import ConfigError, load_config, parse_overrides


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("FLYWHEEL_") and not name.startswith(("FLYWHEEL_TEST_", "FLYWHEEL_CACHE_DIR")):
            monkeypatch.delenv(name)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "flywheel.yaml"
    path.write_text(text)
    return path


def test_defaults_are_the_embedded_ones():
    config = load_config()
    assert config.storage.url.startswith("sqlite+aiosqlite:///")
    assert config.serving.backend == "cpu"
    assert config.serving.model == "demo"


def test_precedence_yaml_then_env_then_overrides(tmp_path, monkeypatch):
    path = write(tmp_path, "serving:\n  port: 31000\n  model: tiny\n  cpu:\n    max_batch_size: 4\n")
    assert load_config(path).serving.port == 31000

    monkeypatch.setenv("FLYWHEEL_SERVING__PORT", "32000")
    monkeypatch.setenv("FLYWHEEL_SERVING__CPU__NUM_THREADS", "1")
    config = load_config(path)
    assert config.serving.port == 32000
    assert config.serving.cpu.num_threads == 1
    assert config.serving.cpu.max_batch_size == 4  # a nested env key keeps the file's siblings
    assert config.serving.model == "tiny"

    config = load_config(path, ["serving.port=33000", "serving.worker_urls=[http://a:1, http://b:2]"])
    assert config.serving.port == 33000
    assert config.serving.worker_urls == ["http://a:1", "http://b:2"]
    assert config.serving.cpu.max_batch_size == 4


def test_string_fields_keep_numeric_looking_values():
    assert load_config(overrides=["serving.model=1.5"]).serving.model == "1.5"
    assert load_config(overrides=["serving.cpu.num_threads=null"]).serving.cpu.num_threads is None


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        (["serving.modle=x"], "unknown config key 'serving.modle'; did you mean 'model'?"),
        (["serving.cpu.max_batch=3"], "did you mean 'max_batch_size'?"),
        (["servng.port=1"], "did you mean 'serving'?"),
        (["storage.urll=sqlite+aiosqlite:///x.db"], "did you mean 'url'?"),
    ],
)
def test_unknown_override_names_key_and_nearest(source, needle):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=source)
    assert needle in str(info.value)


def test_unknown_keys_from_yaml_and_env(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"'serving\.cpu\.dtyp'; did you mean 'dtype'"):
        load_config(write(tmp_path, "serving:\n  cpu:\n    dtyp: float32\n"))
    monkeypatch.setenv("FLYWHEEL_SERVING__PROT", "1")
    with pytest.raises(ConfigError, match="did you mean 'port'"):
        load_config()
    monkeypatch.delenv("FLYWHEEL_SERVING__PROT")
    monkeypatch.setenv("FLYWHEEL_SERVNG__PORT", "1")
    with pytest.raises(ConfigError, match=r"'servng' \(from \$FLYWHEEL_SERVNG__PORT\); did you mean"):
        load_config()


def test_bad_values_and_files_are_clear(tmp_path):
    with pytest.raises(ConfigError, match=r"serving\.port"):
        load_config(overrides=["serving.port=not-a-port"])
    with pytest.raises(ConfigError, match=r"serving\.backend"):
        load_config(overrides=["serving.backend=tpu"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"key\.sub=value"):
        parse_overrides(["serving.port"])


def test_cli_reports_config_errors_with_exit_2(capsys):
    assert main(["config", "serving.modle=x"]) == 2
    assert "did you mean 'model'" in capsys.readouterr().err
    assert main(["config", "serving.port=31234"]) == 0
    assert "port: 31234" in capsys.readouterr().out
