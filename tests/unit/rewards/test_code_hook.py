"""The `code_tests` hook and its sandbox, on real programs in real subprocesses: passing and failing code,
each limit (CPU, wall clock, memory, file size) killing a program and being told apart, no network, the
whole process tree killed, bounded output, a clean environment; and the extraction of the candidate code."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from aiohttp import web

from rewards.hooks import sandbox
from rewards.hooks.code import FACTORIES, CodeTestsArgs, build_program, extract_code
from rewards.hooks.contract import HookContext, HookResult, SessionInput
from rewards.hooks.sandbox import TAIL_BYTES, SandboxMode, SandboxUnavailableError, run_python, sandbox_mode
from tests.support.hook_inputs import NoPool, answered, hook_context

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
LIMITS: dict[str, Any] = {"cpu_s": 5, "memory_mb": 512, "wall_s": 20}
WITHIN = 60.0
"""A generous bound: the call returned instead of hanging."""


@pytest.fixture
async def context() -> AsyncIterator[HookContext]:
    async with httpx.AsyncClient() as http:
        yield hook_context(http, NoPool("code_tests"), timeout_s=120.0)


def session(text: str, task: Any = None, **metadata: Any) -> SessionInput:
    """A one-completion session whose answer is `text`."""
    return answered(text, task=task, **metadata)


async def grade(answer: str, context: HookContext, tests: str | None = TESTS, **args: Any) -> HookResult:
    (factory,) = FACTORIES
    hook = factory.build(factory.args(**args))
    subject = session(answer) if tests is None else session(answer, tests=tests)
    result = await asyncio.wait_for(hook(subject, context), WITHIN)
    assert isinstance(result, HookResult)
    return result


def processes_with(marker: str) -> list[int]:
    """The host's processes whose command line holds `marker` (zombies have none)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline:
                found.append(int(entry.name))
    return found


async def gone(marker: str) -> bool:
    """Whether every process with `marker` ends within a few seconds (the kernel reaps killed ones)."""
    for _ in range(100):
        if not processes_with(marker):
            return True
        await asyncio.sleep(0.1)
    return False


def test_extract_code_takes_the_last_python_block():
    text = "First:\n```python\nx = 1\n```\nBetter:\n```py\nx = 2\n```\nRun it:\n```bash\npython x.py\n```\n"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("Here:\n```\nbare = True\n```\nthanks") == "bare = True\n"
    assert extract_code("```Python3 solution.py\nok = 1\n```") == "ok = 1\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"
    assert extract_code("text\n```python\ncut = 'off'") == "cut = 'off'"
    assert extract_code("```bash\nls\n```") == "```bash\nls\n```"


def test_program_is_candidate_then_tests():
    assert build_program("x = 1\n\n", "assert x == 1") == "x = 1\n\n\nassert x == 1\n"


def test_args_are_checked():
    with pytest.raises(pydantic.ValidationError, match="Extra inputs"):
        CodeTestsArgs.model_validate({"timeout": 3})
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        CodeTestsArgs(cpu_s=0)
    (factory,) = FACTORIES
    assert (factory.name, factory.level, factory.args) == ("code_tests", "session", CodeTestsArgs)


async def test_passing_code_gets_the_pass_reward(context: HookContext):
    result = await grade(f"Sure:\n```python\n{SOLUTION}```\n", context, pass_reward=2.0)
    assert result.session == 2.0
    assert result.details["passed"] is True
    assert (result.details["exit_code"], result.details["killed_by"]) == (0, None)


async def test_failing_assert_gets_the_fail_reward(context: HookContext):
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    result = await grade(wrong, context, fail_reward=-1.0)
    assert result.session == -1.0
    assert result.details["passed"] is False
    assert result.details["exit_code"] == 1
    assert result.details["killed_by"] is None
    assert "AssertionError" in result.details["stderr_tail"]


async def test_no_tests_no_opinion(context: HookContext):
    (factory,) = FACTORIES
    hook = factory.build(CodeTestsArgs())
    assert await hook(session(SOLUTION), context) is None
    assert await hook(session(SOLUTION, task={"checks": TESTS}), context) is None
    other_key = factory.build(CodeTestsArgs(tests_key="checks"))
    result = await other_key(session(SOLUTION, task={"checks": TESTS}), context)
    assert isinstance(result, HookResult) and result.session == 1.0


async def test_an_infinite_loop_is_killed_by_the_cpu_limit(context: HookContext):
    result = await grade("while True:\n    pass\n", context, cpu_s=1, wall_s=30)
    assert result.session == 0.0
    assert result.details["killed_by"] == "cpu"
    assert result.details["exit_code"] is None


@pytest.mark.slow
async def test_ignoring_sigxcpu_still_hits_the_hard_cpu_limit():
    source = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    result = await run_python(source, cpu_s=1, memory_mb=256, wall_s=30)
    assert result.killed_by == "cpu"
    assert not result.passed


async def test_sleeping_forever_is_killed_by_the_wall_clock(context: HookContext):
    result = await grade("import time\nwhile True:\n    time.sleep(1)\n", context, wall_s=2)
    assert result.session == 0.0
    assert result.details["killed_by"] == "wall"


HOGS = ['blob = b" " * 4_000_000_000\n', "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n"]


@pytest.mark.parametrize("hog", HOGS)
async def test_allocating_gigabytes_is_killed_by_the_memory_limit(context: HookContext, hog: str):
    result = await grade(hog, context, memory_mb=256)
    assert result.session == 0.0
    assert result.details["killed_by"] == "memory"
    assert "MemoryError" in result.details["stderr_tail"]


async def test_large_files_are_refused():
    source = f"with open('big', 'wb') as f:\n    f.write(b'x' * {sandbox.FSIZE_BYTES + 1})\n"
    result = await run_python(source, **LIMITS)
    assert not result.passed
    assert "File too large" in result.stderr


async def test_no_network_inside_while_the_test_process_connects() -> None:
    hits: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text="reachable")

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    await web.SockSite(runner, listener).start()
    try:
        source = (
            "import urllib.request\n"
            f"print(urllib.request.urlopen('http://127.0.0.1:{port}/probe', timeout=5).read().decode())\n"
        )
        unsandboxed = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", source, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await asyncio.wait_for(unsandboxed.communicate(), WITHIN)
        assert (unsandboxed.returncode, out.strip(), hits) == (0, b"reachable", ["/probe"])

        result = await run_python(source, **LIMITS)
        assert not result.passed
        assert "URLError" in result.stderr
        assert hits == ["/probe"]
    finally:
        await runner.cleanup()


async def test_the_probe_refuses_a_way_that_leaves_the_network_on(monkeypatch: pytest.MonkeyPatch):
    if [name for _, name in socket.if_nameindex()] == ["lo"]:
        pytest.skip("this machine has no network to leave on")
    monkeypatch.setattr(sandbox, "_probed", [])
    monkeypatch.setattr(
        sandbox,
        "_CANDIDATES",
        (
            SandboxMode(prefix=("env",), drop_root=False),
            SandboxMode(prefix=("no-such-unshare-binary",), drop_root=False),
        ),
    )
    with pytest.raises(SandboxUnavailableError, match="cannot run code without network") as raised:
        await run_python("print('never')", **LIMITS)
    assert "env (drop_root=False): exit 3" in str(raised.value)
    assert "no-such-unshare-binary" in str(raised.value)
    with pytest.raises(SandboxUnavailableError):
        await sandbox_mode()


PID_FLAGS = ("--pid", "--fork", "--kill-child")


@pytest.fixture(params=["probed", "without_pid_namespace"])
async def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> SandboxMode:
    """The sandbox as probed here, and its fallback without a PID namespace (process groups only)."""
    probed = await sandbox_mode()
    if request.param == "probed":
        return probed
    fallback = SandboxMode(
        prefix=tuple(a for a in probed.prefix if a not in PID_FLAGS), drop_root=probed.drop_root
    )
    monkeypatch.setattr(sandbox, "_probed", [fallback])
    return fallback


def spawner(child: str, escaper: str, then: str) -> str:
    """A program that starts `sleep child` (in its group) and `sleep escaper` (in a session of its own)."""
    return (
        "import subprocess, time\n"
        f"subprocess.Popen(['sleep', '{child}'])\n"
        f"subprocess.Popen(['sleep', '{escaper}'], start_new_session=True)\n"
        "print('spawned', flush=True)\n"
        f"{then}\n"
    )


def scratch_dirs() -> set[Path]:
    """The sandbox's scratch directories that exist now."""
    return set(Path(tempfile.gettempdir()).glob("flywheel-sandbox-*"))


def marker() -> str:
    """A unique `sleep` argument to find a process by."""
    return f"9{uuid.uuid4().int % 10**9}.5"


@pytest.mark.slow
async def test_the_whole_process_tree_is_killed_on_wall_timeout(mode: SandboxMode):
    child, escaper = marker(), marker()
    try:
        source = spawner(child, escaper, then="while True:\n    time.sleep(1)")
        result = await asyncio.wait_for(run_python(source, cpu_s=5, memory_mb=512, wall_s=3), WITHIN)
        assert result.killed_by == "wall"
        assert "spawned" in result.stdout
        assert await gone(child)
        if mode.isolates_pids:
            assert await gone(escaper)
    finally:
        for pid in processes_with(child) + processes_with(escaper):
            os.kill(pid, 9)


async def test_children_left_behind_after_exit_are_killed(mode: SandboxMode):
    """A passing program that leaves processes behind still passes (promptly, not killed by the wall
    clock), and its group dies with it. A child that made a session of its own dies too in a PID namespace;
    without one it outlives the sandbox (the fallback's known limit) but does not hold the result up."""
    child, escaper = marker(), marker()
    try:
        result = await asyncio.wait_for(run_python(spawner(child, escaper, then=""), **LIMITS), WITHIN)
        assert result.passed, result
        assert result.stdout == "spawned\n"
        assert await gone(child)
        if mode.isolates_pids:
            assert await gone(escaper)
        else:
            assert processes_with(escaper)
    finally:
        for pid in processes_with(child) + processes_with(escaper):
            os.kill(pid, 9)


async def test_cancelling_the_run_kills_the_program(mode: SandboxMode):
    """The runner cancels a hook past its job's limit: the program and its children die with the call."""
    child, escaper = marker(), marker()
    before = scratch_dirs()
    try:
        source = spawner(child, escaper, then="while True:\n    time.sleep(1)")
        run = asyncio.create_task(run_python(source, cpu_s=5, memory_mb=512, wall_s=300))
        for _ in range(300):
            if processes_with(child) or run.done():
                break
            await asyncio.sleep(0.1)
        assert processes_with(child) and not run.done()
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, WITHIN)
        assert await gone(child)
        assert scratch_dirs() == before
        if mode.isolates_pids:
            assert await gone(escaper)
    finally:
        for pid in processes_with(child) + processes_with(escaper):
            os.kill(pid, 9)


async def test_huge_output_is_truncated_to_its_tail(context: HookContext):
    source = (
        "import sys\nsys.stdout.write('x' * 30_000_000 + 'END')\nsys.stderr.write('y' * 5_000_000 + 'ERR')\n"
    )
    result = await run_python(source, **LIMITS)
    assert result.passed
    assert len(result.stdout) == TAIL_BYTES and result.stdout.endswith("xEND")
    assert len(result.stderr) == TAIL_BYTES and result.stderr.endswith("yERR")
    hooked = await grade(source + "raise SystemExit(1)\n", context, tests="")
    assert hooked.session == 0.0 and len(hooked.details["stderr_tail"]) <= TAIL_BYTES


async def test_a_clean_environment_and_a_scratch_directory(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLYWHEEL_TEST_SECRET", "hunter2")
    source = (
        "import os, sys\n"
        "print(sorted(os.environ))\n"
        "print(os.getcwd())\n"
        "print(sys.flags.isolated)\n"
        "open('scratch.txt', 'w').write('ok')\n"
        "print(sys.stdin.read().upper())\n"
    )
    result = await run_python(source, stdin="from stdin", **LIMITS)
    assert result.passed, result.stderr
    names, cwd, isolated, echoed = result.stdout.splitlines()
    assert names == "['LANG', 'PATH']"
    assert isolated == "1"
    assert echoed == "FROM STDIN"
    assert Path(cwd).name.startswith("flywheel-sandbox-")
    assert not await asyncio.to_thread(os.path.exists, cwd)
    assert result.cpu_s is not None and result.cpu_s >= 0


async def test_limits_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        await run_python("pass", cpu_s=0, memory_mb=64, wall_s=1)
