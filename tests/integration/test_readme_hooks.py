"""The README's custom hook and webhook receiver, taken from the README as written and run for real: the hook
through the registry and a worker process, the receiver as its own process behind the `webhook` hook."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from rewards.hooks.contract import HookContext, HookResult, SessionInput
from rewards.hooks.pool import ProcessHookPool
from rewards.hooks.registry import HookRegistry
from rewards.hooks.spec import HookSpec
from serving.threaded_server import free_port
from tests.support.hook_inputs import answered, hook_context

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block(first_line: str) -> str:
    """The README's Python block whose first line is `first_line`."""
    for block in re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL):
        if block.startswith(first_line):
            return str(block)
    raise AssertionError(f"the README has no python block starting {first_line!r}")


def session(answer_text: str, answer: str | None = "42") -> SessionInput:
    return answered(answer_text) if answer is None else answered(answer_text, answer=answer)


@pytest.fixture
async def context() -> AsyncIterator[HookContext]:
    async with ProcessHookPool(1) as pool, httpx.AsyncClient() as http:
        yield hook_context(http, pool)


@pytest.fixture
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    return tmp_path


async def test_the_readme_custom_hook_plugs_in_by_name(module_dir: Path, context: HookContext) -> None:
    (module_dir / "my_hooks.py").write_text(readme_block("# my_hooks.py"), encoding="utf-8")
    hook = HookRegistry.built_in().resolve(
        HookSpec(hook="my_hooks:right_and_brief", args={"max_words": 5}), "session"
    )
    assert await hook(session("So it is 42"), context) == HookResult(session=1.0)
    assert await hook(session("After a great deal of thought: 42"), context) == HookResult(session=0.9)
    assert await hook(session("It is 41"), context) == HookResult(session=0.0)
    assert await hook(session("42", answer=None), context) is None


@pytest.fixture
def grader(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "grader.py").write_text(readme_block("# grader.py"), encoding="utf-8")
    port = free_port()
    env = {**os.environ, "GRADER_SECRET": "s3cret", "GRADER_PORT": str(port)}
    process = subprocess.Popen([sys.executable, str(tmp_path / "grader.py")], env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "the grader did not start"
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


async def test_the_readme_webhook_receiver_grades_signed_sessions(
    grader: str, context: HookContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = HookRegistry.built_in()
    monkeypatch.setenv("GRADER_SECRET", "s3cret")
    hook = registry.resolve(HookSpec(hook="webhook", args={"url": grader, "secret_env": "GRADER_SECRET"}),
                            "session")
    assert await hook(session("It is 42"), context) == HookResult(session=1.0)
    assert await hook(session("It is 41"), context) == HookResult(session=0.0)
    forged = registry.resolve(HookSpec(hook="webhook", name="forged",
                                       args={"url": grader, "secret": "not-the-secret", "max_attempts": 1}),
                              "session")
    with pytest.raises(Exception, match="401"):
        await forged(session("It is 42"), context)
