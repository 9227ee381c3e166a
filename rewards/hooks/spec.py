"""How a hook is named, in config and when a session or group is created:
`{"hook": "math", "args": {"format_bonus": 0.1}, "weight": 1.0}`.

`hook` is a built-in name (`flywheel rewards hooks` lists them) or a user function `package.module:function`;
`args` are the built-in's arguments (checked when the proxy starts or the session is created) or, for a user
function, extra keyword arguments passed to it. Rewards a hook writes carry the source `hook:<name>`
(`name` defaults to `hook`; two hooks on one session need different names).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from storage.reward_jobs import StoredHook

SOURCE_PREFIX = "hook:"
"""Rewards a hook writes carry the source `hook:<name>`; every other source (REST, AReaL) is a client's."""

SOURCE_MAX_CHARS = 64  # rewards.source

Adapter = Literal["auto", "native", "trl", "verl", "areal", "verifiers"]

HookName = Annotated[str, Field(min_length=1, max_length=56, pattern=r"^[A-Za-z0-9_.:-]+$")]


class HookSpec(BaseModel):
    """One hook on a session or group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hook: Annotated[str, Field(min_length=1, max_length=200)]
    """A built-in hook's name, or `package.module:function`."""
    args: dict[str, Any] = Field(default_factory=dict)
    weight: float = 1.0
    """Hook rewards on one target add up weighted by this (a weighted sum; weights summing to 1 give a
    weighted mean)."""
    name: HookName | None = None
    """The reward source is `hook:<name>`; defaults to `hook`."""
    adapter: Adapter = "auto"
    """User functions only: the shape of the function (TRL `reward_func`, verl `compute_score`, AReaL
    `reward_fn`, a `verifiers` rubric, or this project's own `fn(session)`); "auto" tells them apart by
    their parameter names."""
    timeout_s: Annotated[float, Field(gt=0)] | None = None
    """Longest one run of the hook may take; the runner's default when unset."""
    max_attempts: Annotated[int, Field(ge=1, le=100)] | None = None
    """Runs before the job is marked failed; the runner's default when unset."""

    @field_validator("weight")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("weight must be a finite number")
        return value

    @model_validator(mode="after")
    def _short_source(self) -> HookSpec:
        if len(self.source) > SOURCE_MAX_CHARS:
            raise ValueError(f"the reward source {self.source!r} is longer than {SOURCE_MAX_CHARS} "
                             "characters: give the hook a shorter `name`")
        return self

    @property
    def label(self) -> str:
        """The hook's name in its reward source (`hook:<label>`)."""
        return self.name or self.hook

    @property
    def source(self) -> str:
        return SOURCE_PREFIX + self.label

    @property
    def is_user_function(self) -> bool:
        return ":" in self.hook

    def stored(self) -> dict[str, Any]:
        """The form kept on the session or group row (defaults left out)."""
        return self.model_dump(mode="json", exclude_defaults=True)


class RewardRequestSpec(BaseModel):
    """The `reward` field of a session or group creation: one hook or several."""

    model_config = ConfigDict(extra="forbid")

    hooks: list[HookSpec] = Field(default_factory=list, max_length=16)


def parse_specs(value: Any) -> list[HookSpec]:
    """`reward` as a client sends it (or as the API parsed it): one spec, a list of them, or
    `{"hooks": [...]}`."""
    if value is None:
        return []
    if isinstance(value, list):
        return [HookSpec.model_validate(item) for item in value]
    if isinstance(value, dict) and set(value) == {"hooks"}:
        return list(RewardRequestSpec.model_validate(value).hooks)
    return [HookSpec.model_validate(value)]


def check_unique_sources(specs: list[HookSpec]) -> None:
    """Two hooks on one subject must write different sources."""
    seen: set[str] = set()
    for spec in specs:
        if spec.source in seen:
            raise ValueError(f"two hooks write the reward source {spec.source!r}: give one a distinct `name`")
        seen.add(spec.source)


def stored_hooks(specs: list[HookSpec], default_max_attempts: int) -> list[dict[str, Any]] | None:
    """The `reward_hooks` column of a new session or group (None: no hooks)."""
    stored = [
        StoredHook(source=spec.source, max_attempts=spec.max_attempts or default_max_attempts,
                   spec=spec.stored()).as_json()
        for spec in specs
    ]
    return stored or None
