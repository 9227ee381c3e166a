"""User reward functions, plugged in unchanged: the shapes graders already have, called with a session.

- native: `fn(session: SessionInput, **args)` (or `fn(group: GroupInput, **args)` as a group hook);
- TRL: `reward_func(prompts, completions, completion_ids, **kwargs) -> list[float | None]`, the session's
  final completion as a batch of one (a group hook: the group's sessions as one batch), the task's fields
  as columns;
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info) -> float | {"score": …}`;
- AReaL: `reward_fn(prompt, completions, prompt_ids, completion_ids, answer, **kwargs) -> float`.

A plain (sync) function runs in the hook runner's worker processes, so a grader that hangs is killed at its
timeout and one that burns CPU never stalls the proxy; an `async def` runs on the runner's event loop.
Whatever it returns becomes a `HookResult` (`coerce_result`): a number, None, a verl-style dict with
"score", a list (one value per batch item), or a `HookResult`/`GroupResult`.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rewards.hooks.contract import (
    CompletionView,
    GroupInput,
    GroupResult,
    HookLevel,
    HookResult,
    SessionInput,
)
from rewards.hooks.spec import Adapter

Shape = Adapter


class HookConfigError(ValueError):
    """A hook named in config or at creation cannot be used: unknown, unimportable, or bad arguments."""


def import_function(target: str) -> Callable[..., Any]:
    """`package.module:function` (or `module:Class.attribute`) imported; HookConfigError when it cannot be."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise HookConfigError(f"hook {target!r}: a user hook is named `package.module:function`")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise HookConfigError(f"hook {target!r}: cannot import {module_name!r} ({exc})") from exc
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise HookConfigError(f"hook {target!r}: {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise HookConfigError(f"hook {target!r}: {attribute!r} is not callable")
    return found


def detect_shape(fn: Callable[..., Any]) -> Shape:
    """Which convention `fn` follows, from its parameter names."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "native"
    if {"solution_str", "ground_truth"} <= names:
        return "verl"
    if {"prompt_ids", "completion_ids", "completions", "prompt"} <= names:
        return "areal"
    if {"prompts", "completions"} <= names:
        return "trl"
    return "native"


def is_async(fn: Callable[..., Any]) -> bool:
    call = type(fn).__call__ if not inspect.isfunction(fn) and not inspect.ismethod(fn) else None
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


def check_level(target: str, shape: Shape, level: HookLevel) -> None:
    if level == "group" and shape in ("verl", "areal"):
        raise HookConfigError(f"hook {target!r}: a {shape} function labels one session; name it among "
                              "session hooks, not group hooks")
    if shape == "verifiers":
        raise HookConfigError(
            f"hook {target!r}: verifiers rubrics are not supported yet (verifiers 0.4 needs openai<3, this "
            "Flywheel pins openai 3): call the rubric's reward functions from a native `fn(session)` hook"
        )


def _columns(sessions: Sequence[SessionInput]) -> dict[str, list[Any]]:
    """The task's fields as TRL-style columns (one value per session): metadata first, then the task's."""
    keys: dict[str, None] = {}
    for session in sessions:
        keys.update(dict.fromkeys(session.metadata))
        if isinstance(session.task, Mapping):
            keys.update(dict.fromkeys(session.task))
    return {key: [session.expected(key) for session in sessions] for key in keys}


def _prompt_text(completion: CompletionView | None) -> str:
    if completion is None:
        return ""
    return "\n".join(str(message.get("content") or "") for message in completion.messages)


def call_shape(fn: Callable[..., Any], shape: Shape, subject: SessionInput | GroupInput,
               kwargs: Mapping[str, Any]) -> Any:
    """Call `fn` the way its convention expects (returns what it returns, maybe an awaitable)."""
    if shape == "native":
        return fn(subject, **kwargs)
    sessions = subject.sessions if isinstance(subject, GroupInput) else (subject,)
    finals = [session.final for session in sessions]
    if shape == "trl":
        return fn(
            prompts=[list(final.messages) if final else [] for final in finals],
            completions=[[dict(final.message)] if final else [] for final in finals],
            completion_ids=[list(final.output_ids) if final else [] for final in finals],
            **{**_columns(sessions), **kwargs},
        )
    assert isinstance(subject, SessionInput)
    final = finals[0]
    if shape == "verl":
        truth = subject.expected("ground_truth")
        return fn(
            data_source=subject.expected("data_source"),
            solution_str=subject.answer_text,
            ground_truth=subject.expected("answer") if truth is None else truth,
            extra_info=dict(subject.metadata),
            **kwargs,
        )
    if shape == "areal":
        columns = {key: values[0] for key, values in _columns(sessions).items()}
        return fn(
            _prompt_text(final),
            subject.answer_text,
            list(final.prompt_ids) if final else [],
            list(final.output_ids) if final else [],
            **{**columns, **kwargs},
        )
    raise HookConfigError(f"unknown hook adapter {shape!r}")


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number or None, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {number}")
    return number


def _session_result(raw: Any) -> HookResult | None:
    if raw is None:
        return None
    if isinstance(raw, HookResult):
        return None if raw.empty else raw
    if isinstance(raw, Mapping) and "score" in raw:  # verl's dict form: the score plus extra info
        details = {key: value for key, value in raw.items() if key != "score"}
        score = _number(raw["score"], "the hook's score")
        return None if score is None else HookResult(session=score, details=details)
    score = _number(raw, "the hook's reward")
    return None if score is None else HookResult(session=score)


def coerce_result(raw: Any, subject: SessionInput | GroupInput) -> HookResult | GroupResult | None:
    """What a user function returned, as a hook result for `subject`."""
    if isinstance(subject, GroupInput):
        if raw is None or isinstance(raw, GroupResult):
            return raw
        if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
            raise TypeError("a group hook returns one value per session (a list), a GroupResult or None")
        if len(raw) != len(subject.sessions):
            raise ValueError(f"a group hook returned {len(raw)} values for {len(subject.sessions)} sessions")
        labelled = {
            session.session_id: _session_result(value)
            for session, value in zip(subject.sessions, raw, strict=True)
        }
        return GroupResult(sessions={key: value for key, value in labelled.items() if value is not None})
    if isinstance(raw, Sequence) and not isinstance(raw, str | bytes):  # TRL: a batch of one
        if len(raw) != 1:
            raise ValueError(f"the hook returned {len(raw)} values for one session")
        raw = raw[0]
    return _session_result(raw)


def run_user_function(target: str, shape: Shape, subject: SessionInput | GroupInput,
                      kwargs: Mapping[str, Any]) -> HookResult | GroupResult | None:
    """In a worker process: import the user's function, call it in its shape, coerce what it returns."""
    fn = import_function(target)
    return coerce_result(call_shape(fn, shape, subject, kwargs), subject)


class UserFunctionHook:
    """A user's `module:function` as a hook: sync functions run in the worker processes, async ones on
    the event loop."""

    def __init__(self, target: str, shape: Shape, level: HookLevel, kwargs: Mapping[str, Any]) -> None:
        fn = import_function(target)
        self._target = target
        self._fn = fn
        self._shape: Shape = detect_shape(fn) if shape == "auto" else shape
        check_level(target, self._shape, level)
        self._async = is_async(fn)
        self._kwargs = dict(kwargs)
        self.level: HookLevel = level

    async def __call__(
        self, subject: SessionInput | GroupInput, context: Any
    ) -> HookResult | GroupResult | None:
        if self._async:
            return coerce_result(await call_shape(self._fn, self._shape, subject, self._kwargs), subject)
        return await context.pool.run(run_user_function, self._target, self._shape, subject, self._kwargs,
                                      timeout_s=context.timeout_s)
