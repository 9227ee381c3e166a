"""What a session's end waits for (proxy/sessions.py `SessionCalls`): calls that started before it are
waited for, calls that would start after it are refused."""

from __future__ import annotations

import asyncio

import pytest

from proxy.errors import OpenAIError
from proxy.sessions import SessionCalls


async def test_drained_waits_for_the_calls_that_started_and_close_refuses_new_ones() -> None:
    calls = SessionCalls()
    await asyncio.wait_for(calls.drained("s"), 1)  # nothing running: at once
    calls.enter("s")
    calls.enter("s")
    calls.enter("other")
    calls.close("s")
    with pytest.raises(OpenAIError) as refused:
        calls.enter("s")
    assert refused.value.status == 409 and refused.value.code == "session_ended"
    calls.enter("other")  # other sessions are not affected
    waiting = asyncio.ensure_future(calls.drained("s"))
    calls.leave("s")
    await asyncio.sleep(0)
    assert not waiting.done() and calls.busy("s")
    calls.leave("s")
    await asyncio.wait_for(waiting, 1)
    assert not calls.busy("s") and calls.busy("other")
