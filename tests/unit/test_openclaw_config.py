"""integrations/openclaw/config.py and `flywheel openclaw config`: the provider block OpenClaw reads
(the shape of tests/fixtures/agent-requests/openclaw-provider-config.json), merged into an existing
config without losing its other settings, and a new online key when asked for."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from flywheel.cli import main
from integrations.openclaw.config import ConfigFileError, write_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "agent-requests"
FIXTURE = FIXTURE / "openclaw-provider-config.json"


def test_a_config_is_merged_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "openclaw.json"
    path.write_text(json.dumps({
        "agents": {"defaults": {"workspace": "/w", "model": "other/model"}},
        "models": {"providers": {"other": {"baseUrl": "http://x/v1"}}},
        "channels": {"telegram": {"enabled": True}},
    }))
    config = write_config(path, "http://127.0.0.1:18765", "sk-sess-test", "mock-model")

    captured = json.loads(FIXTURE.read_text())
    ours = config["models"]["providers"]["flywheel"]
    expected = captured["models"]["providers"]["flywheel"]
    assert (ours["baseUrl"], ours["api"]) == (expected["baseUrl"], expected["api"])
    assert ours["apiKey"] == "sk-sess-test" and set(ours) == set(expected)
    assert ours["models"][0]["id"] == "mock-model"
    assert config["agents"]["defaults"]["model"] == captured["agents"]["defaults"]["model"]
    assert config["agents"]["defaults"]["workspace"] == "/w"
    assert config["models"]["providers"]["other"] == {"baseUrl": "http://x/v1"}
    assert config["channels"] == {"telegram": {"enabled": True}}
    assert json.loads(path.read_text()) == config
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds a key


def test_a_base_url_with_or_without_v1_ends_in_v1(tmp_path: Path) -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        config = write_config(tmp_path / "c.json", url, "k", "m")
        assert config["models"]["providers"]["flywheel"]["baseUrl"] == "http://h:1/v1"


def test_a_config_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "openclaw.json"
    path.write_text("{ agents: { defaults: {} }, }  // JSON5")
    with pytest.raises(ConfigFileError, match="not plain JSON"):
        write_config(path, "http://h", "k", "m")
    assert path.read_text().startswith("{ agents")  # untouched


def test_flywheel_openclaw_config_online_makes_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "openclaw.json"
    code = main(["openclaw", "config", "--online", "--out", str(out), "--model", "demo",
                 f"run.dir={tmp_path / 'run'}", "proxy.port=1"])  # nothing listens: the config's values
    assert code == 0
    block = json.loads(out.read_text())["models"]["providers"]["flywheel"]
    assert block["apiKey"].startswith("fw-online-") and block["apiKey"] in capsys.readouterr().out
    assert block["baseUrl"] == "http://127.0.0.1:1/v1" and block["models"][0]["contextWindow"] == 32_768
    listed = main(["keys", "list", "--kind", "online", f"run.dir={tmp_path / 'run'}"])
    assert listed == 0 and "online" in capsys.readouterr().out
