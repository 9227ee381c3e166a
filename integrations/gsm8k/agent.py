"""The demo agent: an ordinary program that solves math word problems with the `openai` client on a
session key; Flywheel's `math` reward hook grades its answers.

`MathAgent` is the agent itself (AReaL's contract: a plain class whose `run()` talks to a
session-scoped OpenAI endpoint). `rollout_group` runs G attempts at one problem as one group: it makes
the group over REST naming the `math` hook (the gold answer is in the group's task), lets G agents
answer concurrently and ends each session; the proxy grades each ended session off the request path,
and the agent reads the hook's reward back for its report. With `grading="rest"` the agent instead
scores each answer itself (`scoring`) and posts the reward over REST before ending the session: the
example of rewards a client sends. `evaluate` answers held-out problems greedily in sessions marked
`{"purpose": "eval"}` that are ended but never rewarded (the agent scores them itself, for its accuracy
report).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import openai

from integrations.gsm8k.problems import Problem
from integrations.gsm8k.rl_api import FlywheelAPIError, RLClient, SessionHandle
from integrations.gsm8k.scoring import DEFAULT_FORMAT_BONUS, extract_answer, is_correct, is_formatted, reward

logger = logging.getLogger(__name__)

HttpClient = openai.DefaultHttpxClient
"""The connection pool agents may share: the HTTP client class the `openai` client is built on."""
Grading = Literal["hook", "rest"]
"""Who rewards training attempts: the proxy's `math` hook, or the agent itself over REST."""
Scoring = Literal["hook", "rest", "local"]
"""What `_answer` does with an answer: leave it to the hook, score it and post the reward, or only score
it (evaluation)."""
REWARD_SOURCE = "gsm8k"
"""The source of the rewards the agent posts itself (grading "rest")."""
HOOK = "math"
HOOK_SOURCE = f"hook:{HOOK}"
"""The source of the rewards the `math` hook writes."""
# "missing_reward": "drop" asks Flywheel's finalizer never to train on these unrewarded sessions.
EVAL_METADATA: dict[str, Any] = {"purpose": "eval", "missing_reward": "drop"}
SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step, then give the final answer on its "
    "own last line as '#### <number>', with no units.\n\n"
    "Example:\nQuestion: Tom has 3 apples and buys 2 more. How many apples does he have?\n"
    "Answer: Tom has 3 + 2 = 5 apples.\n#### 5"
)


class MathAgent:
    """Answers one problem with one chat call. It knows only an OpenAI `base_url` and a session key."""

    def __init__(
        self, base_url: str, api_key: str, *, model: str, temperature: float = 1.0, max_tokens: int = 256,
        system_prompt: str = SYSTEM_PROMPT, timeout_s: float = 600.0, max_retries: int = 2,
        http_client: HttpClient | None = None,
    ) -> None:
        """`http_client` lets many agents share one connection pool (each still sends its own key)."""
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.system_prompt = system_prompt
        self._owns_http_client = http_client is None
        self._client = openai.OpenAI(
            base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=max_retries,
            http_client=http_client,
        )

    def close(self) -> None:
        """Close the connection pool, unless it was lent by the caller."""
        if self._owns_http_client:
            self._client.close()

    def run(self, problem: Problem) -> str:
        """The model's answer text (reasoning ending with `#### <number>`, if it follows the prompt)."""
        response = self._client.chat.completions.create(
            model=self.model,
            messages=[
                {"role": "system", "content": self.system_prompt},
                {"role": "user", "content": problem.question},
            ],
            temperature=self.temperature,
            max_tokens=self.max_tokens,
        )
        return response.choices[0].message.content or ""


@dataclass(frozen=True)
class Attempt:
    """One session's try at a problem. `error` is set (and `reward` None) when its chat call failed;
    such a session is ended without a reward (the agent posts none and reads none back).
    `grading_error` is set (and `reward` None) when the reward hook gave the session no reward."""

    session_id: str
    text: str
    predicted: str | None
    correct: bool
    formatted: bool
    reward: float | None
    error: str | None = None
    grading_error: str | None = None


@dataclass
class GroupResult:
    """G attempts at one problem, in one group."""

    group_id: str
    problem: Problem
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def rewards(self) -> list[float]:
        return [a.reward for a in self.attempts if a.reward is not None]

    @property
    def mean_reward(self) -> float:
        rewards = self.rewards
        return sum(rewards) / len(rewards) if rewards else 0.0


@dataclass(frozen=True)
class EvalResult:
    """Greedy accuracy on held-out problems; failed calls count as wrong and are counted in `errors`."""

    accuracy: float
    correct: int
    total: int
    errors: int
    session_ids: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"accuracy": self.accuracy, "correct": self.correct, "total": self.total,
                "errors": self.errors}


@dataclass(frozen=True)
class AgentSettings:
    """How each agent calls the model, and how its answers are rewarded."""

    model: str
    temperature: float = 1.0
    max_tokens: int = 256
    system_prompt: str = SYSTEM_PROMPT
    timeout_s: float = 600.0
    max_retries: int = 2
    format_bonus: float = DEFAULT_FORMAT_BONUS
    """Reward added for an answer written as `#### N` (the `math` hook's argument, or `scoring`'s)."""
    grading: Grading = "hook"
    """"hook": each group names Flywheel's `math` reward hook, which grades every ended session, and the
    agent reads the reward back; "rest": the agent scores each answer and posts the reward itself."""
    hook_timeout_s: float = 600.0
    """Longest the agent waits for one session's hook to finish (grading "hook")."""

    def __post_init__(self) -> None:
        if self.grading not in ("hook", "rest"):
            raise ValueError(f"grading must be 'hook' or 'rest', got {self.grading!r}")
        if self.format_bonus < 0:
            raise ValueError(f"format_bonus must be >= 0, got {self.format_bonus}")
        if self.hook_timeout_s <= 0:
            raise ValueError(f"hook_timeout_s must be > 0, got {self.hook_timeout_s}")

    def reward_hooks(self) -> dict[str, Any] | list[Any]:
        """The `reward` of each training group: the `math` hook with the format bonus, or (grading
        "rest") no hook, so that no hook the proxy is configured with labels them as well."""
        if self.grading == "rest":
            return []
        return {"hook": HOOK, "args": {"format_bonus": self.format_bonus}}

    def agent(
        self, base_url: str, api_key: str, http_client: HttpClient | None = None
    ) -> MathAgent:
        return MathAgent(
            base_url, api_key, model=self.model, temperature=self.temperature, max_tokens=self.max_tokens,
            system_prompt=self.system_prompt, timeout_s=self.timeout_s, max_retries=self.max_retries,
            http_client=http_client,
        )


def settings_from_kwargs(rl: RLClient, agent_kwargs: Mapping[str, Any] | None) -> AgentSettings:
    """AgentSettings from MathAgent-style keyword arguments; the served model when none is named."""
    kwargs = dict(agent_kwargs or {})
    if kwargs.get("model") is None:
        kwargs["model"] = rl.served_model()
    return AgentSettings(**kwargs)


def _answer(
    rl: RLClient, session: SessionHandle, problem: Problem, settings: AgentSettings,
    http_client: HttpClient | None, *, scoring: Scoring,
) -> Attempt:
    """One session: chat, then (per `scoring`) score and post the reward ("rest"), only score ("local"),
    or neither ("hook": the proxy's hook grades it once it ends); end. A failed chat call still ends
    the session, unrewarded (a broken call says nothing about the policy); a failed REST call raises."""
    agent = settings.agent(rl.openai_base_url, session.api_key, http_client)
    try:
        text = agent.run(problem)
    except openai.APIError as error:
        logger.warning("session %s: the chat call failed: %s", session.session_id, error)
        rl.end_session(session.session_id)
        failure = f"{type(error).__name__}: {error}"
        return Attempt(session.session_id, "", None, False, False, None, error=failure)
    finally:
        agent.close()
    if scoring == "hook":
        rl.end_session(session.session_id)
        return Attempt(session.session_id, text, None, False, False, None)
    predicted = extract_answer(text)
    correct, formatted = is_correct(predicted, problem.answer), is_formatted(text)
    value: float | None = None
    if scoring == "rest":
        value = reward(text, problem.answer, settings.format_bonus)
        details = {"problem_id": problem.id, "predicted": predicted, "gold": problem.answer,
                   "correct": correct, "formatted": formatted}
        rl.reward_session(session.session_id, value, source=REWARD_SOURCE, details=details)
    rl.end_session(session.session_id)
    return Attempt(session.session_id, text, predicted, correct, formatted, value)


def graded_by_hook(attempt: Attempt, view: Mapping[str, Any]) -> Attempt:
    """`attempt` with the reward, answer, correctness and format the `math` hook found, read from the
    session's view (GET /rl/v1/sessions/{id}) once its hooks have finished; reward None (and
    `grading_error` set, with a warning) when the hook failed or gave no reward."""
    jobs = [job for job in view.get("hooks") or [] if job.get("source") == HOOK_SOURCE]
    rewards = [r for r in view.get("rewards") or []
               if r.get("source") == HOOK_SOURCE and r.get("completion_id") is None]
    problem: str | None = None
    if any(job.get("state") == "failed" for job in jobs):
        errors = "; ".join(str(job.get("error")) for job in jobs if job.get("state") == "failed")
        problem = f"the {HOOK} hook failed: {errors}"
    elif not jobs:
        problem = f"the session has no {HOOK} hook (was its group created with it?)"
    elif not rewards:
        problem = f"the {HOOK} hook gave no reward (no gold answer in the task?)"
    if problem is not None:
        logger.warning("session %s is unrewarded: %s", attempt.session_id, problem)
        return replace(attempt, predicted=None, correct=False, formatted=False, reward=None,
                       grading_error=problem)
    row = rewards[-1]
    details = row.get("details") or {}
    predicted = details.get("predicted")
    return replace(
        attempt, reward=float(row["value"]), predicted=None if predicted is None else str(predicted),
        correct=bool(details.get("correct")), formatted=bool(details.get("formatted")),
    )


def read_hook_reward(rl: RLClient, attempt: Attempt, timeout_s: float) -> Attempt:
    """`attempt` graded by the `math` hook (`graded_by_hook`) once the hook has finished on its ended
    session; an attempt whose chat call failed is left as it is (unrewarded)."""
    if attempt.error is not None:
        return attempt
    view = rl.wait_for_hooks(attempt.session_id, timeout_s, sources=[HOOK_SOURCE])
    return graded_by_hook(attempt, view)


def rollout_groups(
    rl: RLClient, problems: Sequence[Problem], group_size: int, settings: AgentSettings, executor: Executor,
    *, http_client: HttpClient | None = None, on_attempt: Callable[[Attempt], None] | None = None,
) -> list[GroupResult]:
    """One group of `group_size` sessions per problem; every attempt runs on `executor` (which bounds
    the concurrency). Groups are created first, so all attempts of a round are in flight together.

    Grading "hook": each group names the `math` hook; as each session ends, its reward is read back
    (`read_hook_reward`), so every attempt returned carries the hook's reward. `on_attempt` is called
    with each attempt once its reward is known."""
    hook = settings.grading == "hook"
    results: list[GroupResult] = []
    pending: list[tuple[GroupResult, Future[Attempt]]] = []
    for problem in problems:
        group = rl.create_group(group_size, task=problem.task(), reward=settings.reward_hooks())
        result = GroupResult(group.group_id, problem)
        results.append(result)
        for session in group.sessions:
            future = executor.submit(_answer, rl, session, problem, settings, http_client,
                                     scoring="hook" if hook else "rest")
            if not hook:
                _report_to(future, on_attempt)
            pending.append((result, future))
    graded: dict[Future[Attempt], Attempt] = {}
    if hook:
        for future in as_completed([f for _, f in pending]):
            graded[future] = read_hook_reward(rl, future.result(), settings.hook_timeout_s)
            if on_attempt is not None:
                on_attempt(graded[future])
    for result, future in pending:
        result.attempts.append(graded[future] if hook else future.result())
    return results


def rollout_group(
    root_url: str, admin_key: str, problem: Problem, group_size: int,
    agent_kwargs: Mapping[str, Any] | None = None, *, concurrency: int | None = None,
) -> GroupResult:
    """Run `group_size` attempts at `problem` as one group: create it over REST, answer concurrently
    (at most `concurrency` at once; all by default), end each session, and read back the reward the
    `math` hook gave it (or, with `grading="rest"`, post each reward before ending). `agent_kwargs` are
    MathAgent's keyword arguments (plus AgentSettings' `format_bonus`, `grading`, `hook_timeout_s`); the
    model defaults to the one the proxy serves."""
    with RLClient(root_url, admin_key) as rl, AgentPool(concurrency or group_size) as (executor, http_client):
        settings = settings_from_kwargs(rl, agent_kwargs)
        return rollout_groups(rl, [problem], group_size, settings, executor, http_client=http_client)[0]


def evaluate_with(
    rl: RLClient, problems: Sequence[Problem], settings: AgentSettings, executor: Executor,
    *, http_client: HttpClient | None = None, on_attempt: Callable[[Attempt], None] | None = None,
) -> EvalResult:
    """Greedy (temperature 0) answers to `problems`, one unrewarded eval session each (no reward hook
    either), scored by the agent itself."""
    greedy = replace(settings, temperature=0.0)
    futures: list[Future[Attempt]] = []
    for problem in problems:
        session = rl.create_session(task=problem.task(), metadata=EVAL_METADATA, reward=[])
        future = executor.submit(_answer, rl, session, problem, greedy, http_client, scoring="local")
        _report_to(future, on_attempt)
        futures.append(future)
    attempts = [future.result() for future in futures]
    correct = sum(a.correct for a in attempts)
    total = len(attempts)
    return EvalResult(
        accuracy=correct / total if total else 0.0, correct=correct, total=total,
        errors=sum(a.error is not None for a in attempts), session_ids=[a.session_id for a in attempts],
    )


def evaluate(
    root_url: str, admin_key: str, problems: Sequence[Problem],
    agent_kwargs: Mapping[str, Any] | None = None, *, concurrency: int = 8,
) -> EvalResult:
    """Held-out accuracy: greedy answers in eval sessions (metadata `{"purpose": "eval"}`, no reward
    hook) that are ended and never rewarded, so a finalizer with `missing_reward=drop` trains on none of
    them."""
    with RLClient(root_url, admin_key) as rl, AgentPool(concurrency) as (executor, http_client):
        return evaluate_with(rl, problems, settings_from_kwargs(rl, agent_kwargs), executor,
                             http_client=http_client)


def _report_to(future: Future[Attempt], on_attempt: Callable[[Attempt], None] | None) -> None:
    """Call `on_attempt` with the attempt when it succeeds (a failure surfaces from `result()`)."""
    if on_attempt is None:
        return

    def done(finished: Future[Attempt]) -> None:
        if not finished.cancelled() and finished.exception() is None:
            on_attempt(finished.result())

    future.add_done_callback(done)


class AgentPool:
    """The executor (`size` threads: the most attempts in flight) and one HTTP connection pool that
    the agents of `rollout_groups` and `evaluate_with` share."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"concurrency must be >= 1, got {size}")
        self.executor = ThreadPoolExecutor(max_workers=size, thread_name_prefix="gsm8k-agent")
        self.http_client = openai.DefaultHttpxClient()

    def __enter__(self) -> tuple[ThreadPoolExecutor, HttpClient]:
        return self.executor, self.http_client

    def __exit__(self, *exc: object) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.http_client.close()


__all__ = [
    "AgentPool", "AgentSettings", "Attempt", "EvalResult", "FlywheelAPIError", "GroupResult", "MathAgent",
    "evaluate", "evaluate_with", "graded_by_hook", "rollout_group", "rollout_groups",
]
