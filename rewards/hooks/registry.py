"""Hook names → hooks: the built-in hooks, and users' `module:function` hooks through their adapters.

Everything a spec names is checked before it is used: when the proxy (or a hook runner) starts, for the hooks
in config, and when a session or group is created, for the hooks it names. An unknown name is a
`HookConfigError` that suggests the nearest valid one; bad arguments are one too, with the argument model's
own message. A resolved hook is built once per spec and reused (a judge keeps its client, a webhook its
secret).
"""

from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Iterable, Sequence

from pydantic import ValidationError

from rewards.hooks.adapters import HookConfigError, UserFunctionHook
from rewards.hooks.contract import Hook, HookFactory, HookLevel
from rewards.hooks.spec import HookSpec, check_unique_sources

BUILT_IN_MODULES = (
    "rewards.hooks.math",
    "rewards.hooks.matching",
    "rewards.hooks.code",
    "rewards.hooks.webhook",
    "rewards.hooks.judge",
    "rewards.hooks.feedback",
)
"""Modules whose `FACTORIES` are the built-in hooks."""


def built_in_factories() -> list[HookFactory]:
    factories: list[HookFactory] = []
    for name in BUILT_IN_MODULES:
        factories.extend(importlib.import_module(name).FACTORIES)
    return factories


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'args'}: {error['msg']}" for error in exc.errors()
    )


class HookRegistry:
    """The hooks one process may run."""

    def __init__(self, factories: Iterable[HookFactory]) -> None:
        self._factories = {factory.name: factory for factory in factories}
        self._built: dict[tuple[str, str], Hook] = {}

    @classmethod
    def built_in(cls) -> HookRegistry:
        return cls(built_in_factories())

    def factories(self) -> list[HookFactory]:
        return sorted(self._factories.values(), key=lambda factory: factory.name)

    def resolve(self, spec: HookSpec, level: HookLevel) -> Hook:
        """The hook `spec` names, built for `level`; HookConfigError when it cannot be."""
        key = (level, json.dumps(spec.stored(), sort_keys=True))
        hook = self._built.get(key)
        if hook is None:
            hook = self._build(spec, level)
            self._built[key] = hook
        return hook

    def check(self, specs: Sequence[HookSpec], level: HookLevel) -> None:
        """Every spec resolves at `level`, and no two write the same source."""
        for spec in specs:
            self.resolve(spec, level)
        try:
            check_unique_sources(list(specs))
        except ValueError as exc:
            raise HookConfigError(str(exc)) from exc

    def _build(self, spec: HookSpec, level: HookLevel) -> Hook:
        if spec.is_user_function:
            return UserFunctionHook(spec.hook, spec.adapter, level, spec.args)
        factory = self._factories.get(spec.hook)
        if factory is None:
            raise HookConfigError(self._unknown(spec.hook))
        if factory.level != level:
            raise HookConfigError(
                f"hook {spec.hook!r} labels a {factory.level}, so it belongs among the {factory.level} hooks"
            )
        if spec.adapter != "auto":
            raise HookConfigError(f"hook {spec.hook!r}: `adapter` is for user functions (`module:function`)")
        try:
            args = factory.args.model_validate(spec.args)
        except ValidationError as exc:
            raise HookConfigError(f"hook {spec.hook!r}: bad args: {_validation_message(exc)}") from exc
        try:
            return factory.build(args)
        except (ValueError, OSError) as exc:
            raise HookConfigError(f"hook {spec.hook!r}: {exc}") from exc

    def _unknown(self, name: str) -> str:
        names = sorted(self._factories)
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return (f"unknown reward hook {name!r}: {hint}built-in hooks are {', '.join(names)}; a user hook is "
                "named `package.module:function`")
