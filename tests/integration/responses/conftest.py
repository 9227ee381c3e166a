"""Fixtures of the Responses API's tests: a scripted worker that writes the scripted `reply` of
tests/support/responses_api.py, and a proxy in front of it that parses Hermes tool calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.proxy_harness import Proxy, ProxyFactory, install_script
from tests.support.responses_api import reply
from tests.support.scripted_worker import ScriptedWorker
from tests.support.text_script import TextScript


@pytest.fixture(name="script")
def script_fixture(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> TextScript:
    return install_script(tiny_model_dir, reply, monkeypatch)


@pytest.fixture(name="proxy")
def proxy_fixture(proxies: ProxyFactory, worker: ScriptedWorker) -> Proxy:
    return proxies.start([worker.url], tool_call_parser="hermes")
