"""How samples meet Flywheel sessions: a `SessionPool` holds one group's sessions and hands one to each
generation task that runs, so every sample of a problem (each copy a controller makes) is a session of
its own. A task carries its binding in `custom_input_params["flywheel"]`; what the worker learned about
the call lands in the task's `customized_result_fields` under the names below."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BINDING_KEY = "flywheel"
SESSION_ID = "session_id"
COMPLETION_ID = "completion_id"
PROMPT_TOKENS = "prompt_tokens"
COMPLETION_TOKENS = "completion_tokens"
PROMPT_TOKEN_IDS = "prompt_token_ids"
ERROR = "error"
REWARD = "reward"
"""Set (maybe to None: no reward) once the reward controller has handled the sample."""
REWARD_DETAILS = "reward_details"
CONTROLLER_NOTES = "controller_notes"
"""What a controller recorded about its choice (a vote's answers, best-of-N's scores)."""
ROLLOUT = "rollout"
"""On the task a trajectory maker was given: the `Rollout` of its group."""


class SessionPoolExhausted(RuntimeError):
    """A controller ran more generation tasks than its group has sessions."""


@dataclass(frozen=True)
class SessionRef:
    """A session and its key. `session_id` is None for a key the caller gave without its id."""

    session_id: str | None
    api_key: str


class SessionPool:
    """The sessions of one group, leased in order, one per generation task. Copies of a task share its
    pool (copying returns the pool itself), which is how copies a controller makes reach their group."""

    def __init__(self, group_id: str | None, sessions: Sequence[SessionRef]) -> None:
        self.group_id = group_id
        self.sessions = list(sessions)
        self.leases: list[tuple[SessionRef, Any]] = []

    def __copy__(self) -> SessionPool:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SessionPool:
        return self

    def lease(self, task: Any) -> SessionRef:
        """The next free session, now owned by `task`; SessionPoolExhausted when all are taken."""
        if len(self.leases) >= len(self.sessions):
            raise SessionPoolExhausted(
                f"group {self.group_id} has {len(self.sessions)} sessions, and its controller ran more "
                "generation tasks than that: make the trajectory maker's samples match the controller's"
            )
        session = self.sessions[len(self.leases)]
        self.leases.append((session, task))
        return session

    def leased_tasks(self) -> list[Any]:
        return [task for _, task in self.leases]

    def unleased(self) -> list[SessionRef]:
        return self.sessions[len(self.leases):]


@dataclass
class Binding:
    """A task's place in Flywheel: the pool its samples lease from, the RL task (e.g. the gold answer a
    reward function reads) and, once leased, its session."""

    pool: SessionPool | None
    task_data: dict[str, Any] = field(default_factory=dict)
    session: SessionRef | None = None


def bind(task: Any, pool: SessionPool | None, task_data: Mapping[str, Any]) -> None:
    """Bind `task` (and every copy later made of it) to `pool`."""
    params = dict(task.custom_input_params or {})
    params[BINDING_KEY] = Binding(pool, dict(task_data))
    task.custom_input_params = params


def binding_of(task: Any) -> Binding | None:
    binding = (getattr(task, "custom_input_params", None) or {}).get(BINDING_KEY)
    return binding if isinstance(binding, Binding) else None


def lease_session(task: Any) -> SessionRef | None:
    """The task's session: the one it holds, else a new lease from its pool; None for an unbound task."""
    binding = binding_of(task)
    if binding is None:
        return None
    if binding.session is None and binding.pool is not None:
        binding.session = binding.pool.lease(task)
    return binding.session


def task_data_of(task: Any) -> dict[str, Any]:
    binding = binding_of(task)
    return {} if binding is None else binding.task_data


def results_of(task: Any) -> dict[str, Any]:
    """The task's `customized_result_fields` (created when a task type lacks them)."""
    fields = getattr(task, "customized_result_fields", None)
    if fields is None:
        fields = {}
        task.customized_result_fields = fields
    return fields


def session_id_of(task: Any) -> str | None:
    """The session a sample's call went to (as the proxy answered), else the one it leased."""
    found = results_of(task).get(SESSION_ID)
    if found:
        return str(found)
    binding = binding_of(task)
    return None if binding is None or binding.session is None else binding.session.session_id


def produced(task: Any) -> bool:
    """Whether the sample's call succeeded (a failed call leaves an error and no output)."""
    return ERROR not in results_of(task) and getattr(task, "output_str", None) is not None
