"""The root config: a YAML file, then `FLYWHEEL_…` environment variables (nested with `__`), then
`key.sub=value` CLI overrides. Each component gets only its own sub-config."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from proxy.config import ProxyConfig
from rewards.config import EvalConfig, RewardsConfig
from serving.config import ServingConfig
from storage.config import StorageConfig
from trainer.config import TrainerConfig

ENV_PREFIX = "FLYWHEEL_"
# FLYWHEEL_* variables that are not config keys: the config file itself, the model cache, test settings.
RESERVED_ENV = ("FLYWHEEL_CONFIG", "FLYWHEEL_CACHE_DIR", "FLYWHEEL_TEST_")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and what to do."""


class RunConfig(BaseModel):
    """Where a run keeps its files."""

    model_config = ConfigDict(extra="forbid")

    dir: Path = Path("flywheel-run")
    """Run directory: the SQLite database by default, checkpoints, logs, reports."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


class OnlineConfig(BaseModel):
    """Online training on live traffic (`flywheel up --online`): the held-out evaluation that gates each
    new version (`trainer.promotion`), and the worker it runs on."""

    model_config = ConfigDict(extra="forbid")

    eval: EvalConfig = Field(default_factory=EvalConfig)
    """The eval set, its reward hook and the eval worker (rewards/evaluation.py)."""
    eval_worker: bool = True
    """`flywheel up` starts one more engine for evaluations (on `serving.port + serving.num_workers`)
    when `eval.worker_url` is unset; evaluations then never take a serving worker's time."""


ONLINE_OVERRIDES = ("trainer.promotion.enabled=true", "trainer.algorithm.ungrouped.kind=running")
"""What `flywheel up --online` sets before the user's own overrides (which still win)."""


class DemoConfig(BaseModel):
    """`flywheel demo`: the math agent's run shape (the agent is a separate process; see
    integrations/gsm8k)."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(20, ge=1)
    """Rounds of rollouts; the trainer takes one step per round (its total_steps)."""
    group_size: int = Field(8, ge=1)
    """G: attempts per problem, one GRPO group."""
    problems_per_step: int = Field(2, ge=1)
    """P: problems per round; the trainer's batch is G x P trajectories."""
    eval_problems: int = Field(40, ge=0)
    """Held-out problems answered greedily before and after training (never trained on)."""
    source: Literal["auto", "gsm8k", "jsonl", "generated"] = "auto"
    """auto: GSM8K through `datasets` when the Hub is reachable, else generated GSM8K-style problems."""
    jsonl: Path | None = None
    """A GSM8K-format JSONL file, with source = jsonl."""
    difficulty: int = Field(1, ge=1)
    """Generated problems: 1 is mostly one step with small numbers."""
    hardware: Literal["auto", "cpu", "gpu"] = "auto"
    """Which flagship run: "gpu" is AReaL's GSM8K quickstart on SGLang (Qwen2.5-1.5B-Instruct, G = 4,
    1024 new tokens, lr 1.7e-5, eps_clip 0.4, η = 2: flywheel/demo.py `GPU_RUN`), so the two can be
    compared; "cpu" is SmolLM2-135M on the CPU engine; "auto" picks "gpu" when CUDA and sglang are both
    there. Either way, a value the user sets wins."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of training attempts. Measured with SmolLM2-135M: at 0.7 (with lr 3e-5
    and G = 4) the policy collapsed to short, identical answers within 20 steps; 1.0 with G = 8 keeps
    groups diverse enough to learn from."""
    max_tokens: int = Field(128, ge=1)
    """Longest answer per attempt."""
    concurrency: int = Field(16, ge=1)
    """Most chat calls in flight at once."""
    version_lag: int = Field(1, ge=0)
    """Rounds the agent may run ahead of the trainer (≤ trainer.max_head_offpolicyness keeps every
    sample trainable)."""
    seed: int = 0


class FlywheelConfig(BaseSettings):
    """Everything one Flywheel deployment needs; build it with `load_config`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    run: RunConfig = Field(default_factory=RunConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    serving: ServingConfig = Field(default_factory=ServingConfig)
    proxy: ProxyConfig = Field(default_factory=ProxyConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    demo: DemoConfig = Field(default_factory=DemoConfig)
    online: OnlineConfig = Field(default_factory=OnlineConfig)

    @model_validator(mode="before")
    @classmethod
    def _admission_follows_trainer(cls, data: Any) -> Any:
        # The proxy is handed only `proxy`: its admission control takes the trainer's B and η, unless
        # proxy.admission sets its own.
        if not isinstance(data, dict) or not isinstance(proxy := data.get("proxy", {}), dict):
            return data
        admission = proxy.get("admission", {})
        if not isinstance(admission, dict):
            return data
        trainer = data.get("trainer", {})
        filled = dict(admission)
        for name in ("batch_size", "max_head_offpolicyness"):
            if filled.get(name) is None:
                default = TrainerConfig.model_fields[name].default
                own = trainer.get(name) if isinstance(trainer, dict) else getattr(trainer, name, None)
                filled[name] = default if own is None else own
        return {**data, "proxy": {**proxy, "admission": filled}}

    @model_validator(mode="after")
    def _promotion_has_an_eval_set(self) -> FlywheelConfig:
        evaluation = self.online.eval
        if self.trainer.promotion.enabled and (evaluation.dataset is None or evaluation.hook is None):
            raise ValueError(
                "trainer.promotion.enabled (flywheel up --online) evaluates every new version before it is "
                "served: set online.eval.dataset (a JSONL eval set) and online.eval.hook (the reward hook "
                "that scores it)"
            )
        return self

    @model_validator(mode="after")
    def _database_in_run_dir(self) -> FlywheelConfig:
        # The embedded SQLite database lives in the run directory unless a URL is given.
        if "url" not in self.storage.model_fields_set:
            self.storage = self.storage.model_copy(
                update={"url": f"sqlite+aiosqlite:///{self.run.dir / 'flywheel.db'}"}
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # load_config merges file, environment and overrides itself, in that order of precedence.
        return (init_settings,)


def load_config(path: Path | str | None = None, overrides: Sequence[str] = ()) -> FlywheelConfig:
    """Read the YAML file (if any), then FLYWHEEL_* env, then `key.sub=value` overrides, and validate."""
    layers: list[dict[str, Any]] = []
    if path is not None:
        layers.append(_read_yaml(Path(path)))
    layers.append(_read_env())
    layers.append(parse_overrides(overrides))
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = _deep_merge(merged, layer)
    try:
        return FlywheelConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """Turn `["serving.port=8000", "serving.worker_urls=[a, b]"]` into a nested dict."""
    result: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        node = result
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} sets a key below a value")
        node[leaf] = _parse_value(raw.strip())
    return result


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _parse_value(raw: str) -> Any:
    # Scalars stay strings so pydantic coerces them to the field's type ("1.0" stays a str for a str
    # field); lists, mappings and null are read as YAML.
    if raw[:1] in "[{" or raw in ("null", "~"):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"cannot parse value {raw!r}: {exc}") from None
    return raw


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _read_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    import os

    environ = os.environ if environ is None else environ
    known = {name.upper() for name in FlywheelConfig.model_fields}
    for name in environ:
        if not name.startswith(ENV_PREFIX) or name.startswith(RESERVED_ENV):
            continue
        top = name[len(ENV_PREFIX):].split("__", 1)[0]
        if top not in known:
            key = top.lower()
            raise ConfigError(f"unknown config key {key!r} (from ${name}){_hint(key, FlywheelConfig)}")
    return EnvSettingsSource(FlywheelConfig)()


def _explain(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        key = ".".join(loc)
        if error["type"] == "extra_forbidden":
            owner = _model_at(FlywheelConfig, loc[:-1])
            lines.append(f"unknown config key {key!r}{_hint(loc[-1], owner)}")
        else:
            lines.append(f"{key}: {error['msg']} (got {error.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def _model_at(model: type[BaseModel] | None, path: list[str]) -> type[BaseModel] | None:
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        annotation = model.model_fields[part].annotation
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model


def _hint(key: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return ""
    valid = list(model.model_fields)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; valid keys here: {', '.join(valid)}"
