"""Loaders and checks of tests/unit/test_compose.py, which reads docker-compose.yml, docker-compose.gpu.yml
and deploy/ without a Docker engine: the compose files as compose resolves them (anchors, `${NAME}`
interpolation, the GPU override merged in), each Flywheel service's command line parsed by the real CLI
and its config loaded from its environment, and the checks themselves. Each check is a function listing
what is wrong, so that the tests can also show it catching a broken copy."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from flywheel.cli import build_parser
from flywheel.config import FlywheelConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "fixtures" / "compose-spec.json"
NGINX = ROOT / "deploy" / "nginx.conf"
JOIN_RAY = ROOT / "deploy" / "join-ray.sh"
FLYWHEEL_IMAGE = "flywheel:local"
FLYWHEEL_SERVICES = ("migrate", "cli", "engine", "proxy-a", "proxy-b", "rewards", "trainer")
PROXIES = ("proxy-a", "proxy-b")
RAY_NODES = ("ray-head", "ray-worker")
DOTENV = {"FLYWHEEL_KEY_SECRET": "f00d" * 16}
"""What a deployment's `.env` beside docker-compose.yml holds."""
GPU_DOTENV = {**DOTENV, "GPU_MODEL": "Qwen/Qwen2.5-0.5B-Instruct"}
CHECKPOINTS = "flywheel-run:/srv/flywheel-run"
RAY_ADDRESS_ENV = "FLYWHEEL_TRAINER__RAY__ADDRESS"
Compose = dict[str, Any]


def read_compose(name: str) -> Compose:
    loaded = yaml.safe_load((ROOT / name).read_text())  # resolves the anchors and `<<` merges
    assert isinstance(loaded, dict)
    return loaded


def interpolate(value: Any, dotenv: dict[str, str]) -> Any:
    """Compose's `${NAME}`, `${NAME:-default}` and `${NAME:?error}` in every string of `value`."""
    if isinstance(value, dict):
        return {key: interpolate(item, dotenv) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, dotenv) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        name, operator, argument = match.groups()
        if dotenv.get(name):
            return dotenv[name]
        if operator == ":?":
            raise ValueError(f"compose refuses to start: {name}: {argument}")
        return argument or ""

    return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", substitute, value)


def merged(base: Any, override: Any) -> Any:
    """An override file applied to a compose file as compose applies mappings (environment, depends_on):
    key by key, the override's values winning."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return override
    result = dict(base)
    for key, value in override.items():
        result[key] = merged(base[key], value) if key in base else value
    return result


def set_at(document: Compose, path: tuple[Any, ...], value: Any) -> Compose:
    """`document` with the value at `path` replaced, in place: how a test breaks a copy."""
    node = document
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return document


def flywheel_argv(argv: list[str]) -> tuple[Any, list[str]]:
    """Parse as `flywheel.cli.main` does: options and overrides in any order; anything else is refused."""
    args, extra = build_parser().parse_known_args(argv)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    assert not unknown, f"`flywheel {shlex.join(argv)}`: unrecognized {unknown}"
    return args, [*args.overrides, *extra]


def config_of(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, FlywheelConfig]:
    """The service's command line parsed by the real CLI, and its config loaded from its environment."""
    for key in [k for k in os.environ if k.startswith("FLYWHEEL_")]:
        monkeypatch.delenv(key)
    for key, value in service["environment"].items():
        monkeypatch.setenv(key, str(value))
    args, overrides = flywheel_argv(service["command"])
    return args, load_config(None, overrides)


def runs_flywheel(service: dict[str, Any]) -> bool:
    """The image's entrypoint is `flywheel`; deploy/join-ray.sh ends in `exec flywheel "$@"`."""
    entrypoint = service.get("entrypoint")
    return service.get("image") == FLYWHEEL_IMAGE and (entrypoint is None or JOIN_RAY.name in entrypoint[-1])


def compose_config(
    binary: list[str], directory: Path, dotenv: dict[str, str], *files: str
) -> subprocess.CompletedProcess[str]:
    """`config -q` on `files` in `directory`, with `dotenv` as the only variables (and profile gpu on)."""
    env_file = directory / "test.env"
    env_file.write_text("".join(f"{key}={value}\n" for key, value in dotenv.items()))
    argv = [*binary, "--project-directory", str(directory), "--env-file", str(env_file)]
    argv += [arg for name in files for arg in ("-f", str(directory / name))]
    env = {k: v for k, v in os.environ.items() if k not in DOTENV and not k.startswith("COMPOSE_")}
    return subprocess.run([*argv, "--profile", "gpu", "config", "-q"], capture_output=True, text=True,
                          env=env, timeout=120)


def _ray_start(argv: list[str]) -> dict[str, Any]:
    """`ray start` options as Ray's own command line parses them (an unknown option raises)."""
    from ray.scripts.scripts import start

    assert argv[0] == "start", argv
    return dict(start.make_context("ray start", list(argv[1:])).params)


def _script_ray_start(script: str) -> list[str]:
    """The `ray start …` arguments of deploy/join-ray.sh (after `ray`), its continuation lines joined."""
    joined = script.replace("\\\n", " ")
    line = next(line for line in joined.splitlines() if line.strip().startswith("ray start"))
    return shlex.split(line.replace('"$FLYWHEEL_TRAINER__RAY__ADDRESS"', "HEAD"))[1:]


def _nginx_upstreams(conf: str) -> dict[str, list[tuple[str, int]]]:
    text = re.sub(r"#[^\n]*", "", conf)
    blocks = re.findall(r"upstream\s+(\w+)\s*\{(.*?)\}", text, flags=re.S)
    server = re.compile(r"^\s*server\s+([\w.-]+):(\d+)", flags=re.M)
    return {name: [(host, int(port)) for host, port in server.findall(body)] for name, body in blocks}


# The checks: each returns what is wrong, empty when nothing is.


def schema_errors(document: Compose) -> list[str]:
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = validator.iter_errors(document)
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in errors]


def nginx_problems(compose: Compose, conf: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    services = compose["services"]
    problems = []
    upstreams = _nginx_upstreams(conf)
    passed_to = set(re.findall(r"proxy_pass\s+http://(\w+)\s*;", conf))
    if not passed_to or not passed_to <= set(upstreams):
        problems.append(f"proxy_pass names {passed_to}, the upstreams are {set(upstreams)}")
    expected = []
    proxies = [name for name, service in services.items() if runs_flywheel(service)
               and flywheel_argv(service["command"])[0].command == "proxy"]
    for name in proxies:
        _, config = config_of(services[name], monkeypatch)
        if config.proxy.host != "0.0.0.0":
            problems.append(f"{name} listens on {config.proxy.host}: the load balancer cannot reach it")
        expected.append((name, config.proxy.port))
    for name, servers in upstreams.items():
        if sorted(servers) != sorted(expected):
            problems.append(f"upstream {name} has {servers}, the proxy services are {expected}")
    listen = re.findall(r"^\s*listen\s+(\d+)\s*;", conf, flags=re.M)
    published = [str(port).rsplit(":", 1)[-1] for port in services["lb"]["ports"]]
    if listen != published:
        problems.append(f"nginx listens on {listen}, lb publishes {published}")
    for directive in ("proxy_buffering off", "proxy_request_buffering off", "proxy_http_version 1.1"):
        if not re.search(rf"^\s*{directive}\s*;", conf, flags=re.M):
            problems.append(f"streaming needs `{directive};`")
    read_timeouts = [int(s) for s in re.findall(r"^\s*proxy_read_timeout\s+(\d+)s\s*;", conf, flags=re.M)]
    _, proxy = config_of(services[proxies[0]], monkeypatch)
    if not read_timeouts or min(read_timeouts) < proxy.proxy.resume_timeout_s:
        problems.append(f"proxy_read_timeout {read_timeouts} is shorter than a call may wait")
    return problems


def ray_problems(compose: Compose, script: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    services = compose["services"]
    head, worker = (_ray_start(services[name]["command"]) for name in RAY_NODES)
    driver = _ray_start(_script_ray_start(script))
    problems = [f"{name} does not run `ray`" for name in RAY_NODES
                if services[name].get("entrypoint") != ["ray"]]
    head_address = f"ray-head:{head['port']}"
    if not head["head"] or worker["head"] or worker["address"] != head_address:
        problems.append(f"ray-worker joins {worker['address']}, the head listens at {head_address}")
    _, trainer = config_of(services["trainer"], monkeypatch)
    if trainer.trainer.ray.address != head_address:
        problems.append(f"trainer.ray.address is {trainer.trainer.ray.address}, the head is {head_address}")
    entrypoint = services["trainer"].get("entrypoint") or []
    mounts = [volume.split(":") for volume in services["trainer"]["volumes"]]
    mounted = {mount[1] for mount in mounts if mount[0] == f"./deploy/{JOIN_RAY.name}"}
    if not entrypoint or entrypoint[-1] not in mounted:
        problems.append(f"the trainer's entrypoint {entrypoint} is not deploy/{JOIN_RAY.name} as mounted")
    if not script.rstrip().endswith('exec flywheel "$@"') or driver["num_cpus"] != 0:
        problems.append("join-ray.sh must join with no CPUs, then exec flywheel with the service's command")
    fixed = ("node_manager_port", "object_manager_port", "min_worker_port", "max_worker_port",
             "dashboard_agent_grpc_port", "dashboard_agent_listen_port", "runtime_env_agent_port")
    for option in fixed:
        values = {head[option], worker[option], driver[option]}
        if None in values or len(values) != 1:
            problems.append(f"--{option.replace('_', '-')} differs between nodes or is unset: {values}")
    return problems


def volume_problems(compose: Compose) -> list[str]:
    """The trainer's checkpoints must be readable by every worker a disk weight push reaches, at the
    trainer's path, and by every Ray node the policy actor may run on."""
    services = compose["services"]
    readers = ["engine", "trainer", *RAY_NODES, "sglang"]
    problems = [f"{name} lacks {CHECKPOINTS}" for name in readers
                if CHECKPOINTS not in services[name]["volumes"]]
    if "flywheel-run" not in compose["volumes"]:
        problems.append("the flywheel-run volume is not declared")
    return problems


def profile_problems(compose: Compose) -> list[str]:
    """The GPU services start only with `--profile gpu`, and nothing started by default waits on them."""
    services = compose["services"]
    problems = []
    if services["sglang"].get("profiles") != ["gpu"]:
        problems.append("sglang is not in the gpu profile only")
    by_default = {name for name, service in services.items() if not service.get("profiles")}
    for name in sorted(by_default):
        needs = set(services[name].get("depends_on", {})) - by_default
        if needs:
            problems.append(f"{name} (started by default) depends on {needs}, which are not")
    devices = services["sglang"]["deploy"]["resources"]["reservations"]["devices"]
    if not any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices):
        problems.append("sglang reserves no NVIDIA GPU")
    return problems
