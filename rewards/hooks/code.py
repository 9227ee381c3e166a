"""The `code_tests` hook: run the model's code against the task's tests in the sandbox, and reward a pass.

The candidate is the last fenced Python code block of the session's answer (```python, ```py or a bare
```), else the whole answer; the tests are Python source (asserts) the agent attached under `tests_key`.
The program run is the candidate followed by the tests: exit status 0 within the limits is a pass. A program
killed by a limit (CPU, memory, wall clock) is scored as a failure, not an error; a machine where code
cannot run without network raises `SandboxUnavailableError` (the job fails, nothing is scored).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rewards.hooks.contract import GroupInput, HookContext, HookFactory, HookLevel, HookResult, SessionInput
from rewards.hooks.matching import fenced_blocks
from rewards.hooks.sandbox import SandboxResult, run_python

PYTHON_FENCES = frozenset({"", "python", "py", "python3"})
"""Info strings of the fenced blocks that count as Python code."""


class CodeTestsArgs(BaseModel):
    """Arguments of `code_tests`: where the tests are, the sandbox's limits, and the two rewards."""

    model_config = ConfigDict(extra="forbid")

    tests_key: str = "tests"
    """The key of the tests (Python source) in the session's metadata or task."""
    cpu_s: float = Field(default=5.0, gt=0)
    memory_mb: int = Field(default=512, ge=16)
    wall_s: float = Field(default=10.0, gt=0)
    pass_reward: float = 1.0
    fail_reward: float = 0.0


def extract_code(text: str) -> str:
    """The last fenced Python (or bare) code block of `text`, else the whole text."""
    for info, body in reversed(fenced_blocks(text)):
        if info in PYTHON_FENCES:
            return body
    return text


def build_program(candidate: str, tests: str) -> str:
    """The program the sandbox runs: the candidate, then the tests."""
    return f"{candidate.rstrip()}\n\n\n{tests.rstrip()}\n"


def score(result: SandboxResult, args: CodeTestsArgs) -> HookResult:
    """The reward of one run and what is stored beside it."""
    passed = result.passed
    return HookResult(
        session=args.pass_reward if passed else args.fail_reward,
        details={
            "passed": passed,
            "killed_by": result.killed_by,
            "exit_code": result.exit_code,
            "signal": result.signal,
            "stderr_tail": result.stderr,
        },
    )


class CodeTestsHook:
    """Runs the session's final code against its tests; None when the session has no tests."""

    level: HookLevel = "session"

    def __init__(self, args: CodeTestsArgs) -> None:
        self.args = args

    async def __call__(self, subject: SessionInput | GroupInput, context: HookContext) -> HookResult | None:
        if not isinstance(subject, SessionInput):
            raise TypeError("code_tests is a session hook")
        tests: Any = subject.expected(self.args.tests_key)
        if tests is None:
            return None
        if not isinstance(tests, str):
            raise TypeError(f"{self.args.tests_key!r} must be Python source, not {type(tests).__name__}")
        program = build_program(extract_code(subject.answer_text), tests)
        result = await run_python(
            program, cpu_s=self.args.cpu_s, memory_mb=self.args.memory_mb, wall_s=self.args.wall_s
        )
        return score(result, self.args)


FACTORIES: tuple[HookFactory, ...] = (
    HookFactory(
        name="code_tests",
        level="session",
        args=CodeTestsArgs,
        build=CodeTestsHook,
        summary="Runs the answer's last Python code block with the task's tests in a sandbox; pass → reward",
    ),
)
